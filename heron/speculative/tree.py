"""A static tree of draft candidates, verified by the target in one pass (tree attention).

``speculative_token_tree`` (vLLM's key) lists the nodes as paths of choice ranks: ``(0,)`` is
the draft's top token after the sequence, ``(1,)`` its second choice there, ``(0, 0)`` the
top token after ``(0,)``, and so on. heron's drafters decode one greedy chain (the all-zero
paths) and read every other candidate from the ranked choices at a chain position, so a
node's parent must be on the chain: ``(0, 1)`` is allowed, ``(1, 0)`` is not. Nodes are laid
out by depth, then rank; the draft tokens of a sequence are its nodes' tokens in that order.

In the verifying step a sequence computes its last token (the root, row 0) and one row per
node: node ``n`` sits at position ``root + depth(n)`` (siblings share one) in its own KV slot
(row n + 1), and attends to the context, the root and its ancestors (``attention_mask``).
The accepted path's KV is then moved to the slots of its positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from heron.config import parse_token_tree


@dataclass(frozen=True)
class DraftTree:
    """The nodes of ``SpeculativeConfig.tree_paths`` (checked there), with what drafting,
    the verifying step's layout and verification derive from them."""

    paths: tuple[tuple[int, ...], ...]  # node n's choice ranks from the root

    @classmethod
    def parse(cls, spec: str | list) -> DraftTree:
        """From ``"[(0,), (1,), (0, 0)]"`` (or the list itself); ValueError if malformed."""
        return cls(parse_token_tree(spec))

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    @property
    def max_rank(self) -> int:
        return max(p[-1] for p in self.paths)

    def depths(self) -> list[int]:
        return [len(p) for p in self.paths]

    def parents(self) -> list[int]:
        """Node index of each node's parent, -1 for the root."""
        index = {p: n for n, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    def children(self) -> list[list[int]]:
        """Children of the root (entry 0) and of node n (entry n + 1), by rank."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for n, parent in enumerate(self.parents()):
            kids[parent + 1].append(n)
        return kids

    def attention_mask(self) -> torch.Tensor:
        """(1 + N, 1 + N) bool: row r (0 = root, n + 1 = node n) sees itself, the root and
        its ancestors."""
        size = self.num_nodes + 1
        mask = torch.zeros(size, size, dtype=torch.bool)
        mask[:, 0] = True
        for n, parent in enumerate(self.parents()):
            mask[n + 1] = mask[parent + 1]
            mask[n + 1, n + 1] = True
        mask[0, 1:] = False
        return mask

    def tokens_from_choices(self, ranked: list[list[int]]) -> list[int]:
        """Node tokens from the drafter's ranked choices: ``ranked[d][r]`` is its rank-r token
        after d chain tokens."""
        return [ranked[len(p) - 1][p[-1]] for p in self.paths]

    @cached_property
    def _layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(node depths (N,), attention mask (1 + N, 1 + N)), built once."""
        return torch.tensor(self.depths()), self.attention_mask()

    def lay_out(self, positions: torch.Tensor, query_start_loc: list[int],
                drafts: list[list[int]]) -> dict[int, torch.Tensor]:
        """Lay a verifying step out, in place: sequence ``i`` with drafts (its node tokens)
        computes its last token (the root) and then one row per node; node n moves to
        position root + depth(n) (its KV slot stays that of its row, root + 1 + n).
        positions (T,) are the step's; returns the attention mask of each such sequence."""
        depths, mask = self._layout
        masks = {}
        for i, nodes in enumerate(drafts):
            if nodes:
                root = query_start_loc[i + 1] - 1 - len(nodes)
                positions[root + 1:root + 1 + len(nodes)] = positions[root] + depths
                masks[i] = mask
        return masks

    def path_moves(self, query_start_loc: list[int], sampling: list[int],
                   paths: list[list[int]]) -> tuple[list[int], list[int]]:
        """(source rows, destination rows) that move each accepted path to the rows (and KV
        slots) of its positions: the node at depth d was computed in row root + 1 + node, its
        position's row is root + d. ``paths[j]``: the accepted nodes of sequence
        ``sampling[j]``, root to leaf."""
        src, dst = [], []
        for j, path in enumerate(paths):
            root = query_start_loc[sampling[j] + 1] - 1 - self.num_nodes
            for depth, node in enumerate(path, start=1):
                if node + 1 != depth:
                    src.append(root + 1 + node)
                    dst.append(root + depth)
        return src, dst
