"""Verify a tree of draft candidates (``tree.DraftTree``) in one pass: walk from the root,
accepting at each node one of its children, until none is accepted or a leaf is reached.

Row 0 of a sequence is the target after the sequence, row n + 1 the target after node n's
path. Greedy: follow the child whose token is the row's argmax; the first row without such
a child gives the last token, so the output is exactly greedy decoding's. Sampling: at a
node with distribution p, try its children by rank (each a distinct, deterministic
candidate): accept child c with probability p(c), else remove c from p and renormalise;
when every child is rejected draw from what is left, and at a leaf from p. Each emitted
token is distributed exactly as under p (lossless; SpecInfer's multi-candidate rule with
one-hot proposals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.outputs import PositionLogprobs
from heron.sample.draw import draw
from heron.sample.filters import sampling_probs
from heron.sample.logprobs import top_logprobs
from heron.sample.processing import process_logits
from heron.sample.rows import SamplingRow
from heron.speculative.draft_row import DraftRow
from heron.speculative.tree import DraftTree


@dataclass
class TreeVerifyOutput:
    token_ids: list[list[int]]  # per sequence: the accepted path's tokens, then one more
    paths: list[list[int]]  # per sequence: the accepted nodes, root to leaf
    logprobs: list[list[PositionLogprobs] | None]


def verify_tree(logits: torch.Tensor, states: list[SamplingRow], drafts: list[list[int]],
                tree: DraftTree, generator: torch.Generator) -> TreeVerifyOutput:
    """logits (R, V): 1 + N rows per sequence with a tree (``drafts[i]``: its N node tokens),
    1 row per sequence without drafts (``drafts[i] == []``)."""
    parents, children = tree.parents(), tree.children()
    rows, starts = [], [0]
    for state, nodes in zip(states, drafts):
        rows.append(DraftRow(state, []))
        rows.extend(DraftRow(state, _path_tokens(n, nodes, parents)) for n in
                    range(len(nodes)))
        starts.append(len(rows))
    raw, logits = process_logits(logits, rows)
    targets = logits.argmax(-1).tolist()
    probs = None
    if any(not s.params.greedy for s in states):
        probs = sampling_probs(logits, rows).cpu()  # (R, V) every row: rows are few per sequence
    tokens, paths, logprobs = [], [], []
    for i, state in enumerate(states):
        walk = _walk_greedy if state.params.greedy else _walk_sampled
        kids = children if drafts[i] else [[]]
        path, chosen_at, emitted = walk(starts[i], drafts[i], kids, targets, probs, state,
                                        generator)
        tokens.append(emitted)
        paths.append(path)
        logprobs.append(None if state.params.logprobs is None else [
            top_logprobs(raw[r].cpu(), t, state.params.logprobs)
            for r, t in zip(chosen_at, emitted)])
    return TreeVerifyOutput(tokens, paths, logprobs)


def _path_tokens(node: int, nodes: list[int], parents: list[int]) -> list[int]:
    """The tokens from the root to ``node`` (inclusive)."""
    path = []
    while node >= 0:
        path.append(nodes[node])
        node = parents[node]
    return path[::-1]


def _walk_greedy(start, nodes, children, targets, probs, state, generator):
    """(accepted nodes, the row each emitted token was chosen at, the emitted tokens)."""
    path, chosen_at, emitted, cursor = [], [], [], -1
    while True:
        row = start + cursor + 1
        token = targets[row]
        chosen_at.append(row)
        emitted.append(token)
        match = next((c for c in children[cursor + 1] if nodes[c] == token), None)
        if match is None:
            return path, chosen_at, emitted
        path.append(match)
        cursor = match


def _walk_sampled(start, nodes, children, targets, probs, state, generator):
    path, chosen_at, emitted, cursor = [], [], [], -1
    gen = state.generator or generator
    while True:
        row = start + cursor + 1
        p = probs[row].clone()
        chosen_at.append(row)
        accepted = None
        for child in children[cursor + 1]:  # by rank
            u = float(torch.rand(1, generator=gen, device=gen.device))
            if u < float(p[nodes[child]]):
                accepted = child
                break
            p[nodes[child]] = 0.0
            total = p.sum()
            if total <= 0:
                break  # the children held all the mass (rounding): draw from what is left
            p /= total
        if accepted is None:
            # residual (or, at a leaf, p itself); draw uses the state's own generator if seeded
            emitted.append(int(draw(p.unsqueeze(0).to(generator.device), [state],
                                     generator)[0]))
            return path, chosen_at, emitted
        emitted.append(nodes[accepted])
        path.append(accepted)
        cursor = accepted
