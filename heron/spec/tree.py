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

import ast
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    paths: tuple[tuple[int, ...], ...]  # node n's choice ranks from the root

    @classmethod
    def parse(cls, spec: str | list) -> DraftTree:
        """From ``"[(0,), (1,), (0, 0)]"`` (or the list itself); ValueError if malformed."""
        try:
            raw = ast.literal_eval(spec) if isinstance(spec, str) else spec
            paths = sorted({tuple(int(r) for r in p) for p in raw}, key=lambda p: (len(p), p))
        except (ValueError, SyntaxError, TypeError) as exc:
            raise ValueError(f"speculative_token_tree must be a list of tuples of ranks, "
                             f"e.g. [(0,), (1,), (0, 0)]: {exc}") from None
        tree = cls(tuple(paths))
        tree._check()
        return tree

    def _check(self) -> None:
        if not self.paths:
            raise ValueError("speculative_token_tree has no nodes")
        known = set(self.paths)
        for path in self.paths:
            if not path or min(path) < 0:
                raise ValueError(f"tree node {path}: ranks must be >= 0, paths non-empty")
            if any(path[:-1]):
                raise ValueError(f"tree node {path}: a node's parent must be on the greedy "
                                 f"chain (all ranks 0 but the last)")
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"tree node {path} has no parent {path[:-1]}")

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
