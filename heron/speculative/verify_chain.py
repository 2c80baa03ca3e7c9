"""Verify draft tokens against the target model: speculative decoding's acceptance step.

A sequence that verifies ``k`` drafts ``d_0 .. d_{k-1}`` has ``k + 1`` logit rows: row ``j``
is the target's next-token distribution after the sequence plus ``d_0 .. d_{j-1}``. Every row
goes through the sampler's own processing (penalties and min_tokens over the tokens it
follows, drafts included; temperature, top-k, top-p, min-p), giving ``p_j``.

- Greedy: accept drafts while ``d_j == argmax p_j``; the first row that disagrees (or row
  ``k``) gives the bonus token, so the output is exactly non-speculative greedy decoding.
- Sampling (Leviathan et al. 2023, Chen et al. 2023): accept ``d_j`` with probability
  ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection draw from the residual
  ``max(0, p_j - q_j)`` renormalised; if all are accepted draw the bonus from ``p_k``. Each
  emitted token is then distributed exactly as under ``p`` (lossless). heron's proposers
  draft deterministically (argmax, or prompt lookup), so ``q_j`` is one-hot on ``d_j``:
  accept with probability ``p_j(d_j)``, residual = ``p_j`` without ``d_j``.

Seeded sequences draw every uniform and every token from their own generator, so a seed
gives the same tokens run after run (not the same tokens as without speculation).
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


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per sequence: accepted drafts, then one token of its own
    logprobs: list[list[PositionLogprobs] | None]  # per sequence, one entry per token


def verify(logits: torch.Tensor, states: list[SamplingRow], drafts: list[list[int]],
           generator: torch.Generator,
           draft_probs: list[torch.Tensor | None] | None = None) -> VerifyOutput:
    """logits: (R, V), R = sum(len(d) + 1 for d in drafts), sequence ``i``'s rows
    contiguous in order. ``draft_probs[i]``: (len(drafts[i]), V) proposal probabilities,
    None (default) for a deterministic proposer (one-hot)."""
    rows = [DraftRow(s, d[:j]) for s, d in zip(states, drafts) for j in range(len(d) + 1)]
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    raw_logprobs, logits = process_logits(logits, rows)
    targets = logits.argmax(-1).tolist()  # (R,) the greedy choice of every row
    accepted = [_accept_greedy(drafts[i], targets[starts[i]:starts[i + 1]])
                if s.params.greedy else 0 for i, s in enumerate(states)]
    tokens = [drafts[i][:a] + [targets[starts[i] + a]] for i, a in enumerate(accepted)]
    sampling = [i for i, s in enumerate(states) if not s.params.greedy]
    if sampling:
        _verify_sampled(logits, rows, states, drafts, starts, sampling, generator,
                        draft_probs, tokens)
    logprobs: list[list[PositionLogprobs] | None] = [None] * len(states)
    for i, s in enumerate(states):
        if s.params.logprobs is not None:
            wanted = raw_logprobs[starts[i]:starts[i] + len(tokens[i])].cpu()
            logprobs[i] = [top_logprobs(wanted[j], t, s.params.logprobs)
                           for j, t in enumerate(tokens[i])]
    return VerifyOutput(tokens, logprobs)


def _accept_greedy(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's argmax at their row."""
    for j, d in enumerate(drafts):
        if targets[j] != d:
            return j
    return len(drafts)


def _verify_sampled(logits, rows, states, drafts, starts, sampling, generator, draft_probs,
                    tokens) -> None:
    """Rejection sampling for the sampling sequences; writes their ``tokens``."""
    row_idx = [r for i in sampling for r in range(starts[i], starts[i + 1])]
    probs = sampling_probs(logits[row_idx], [rows[r] for r in row_idx])  # (Rs, V)
    local, n = {}, 0  # sequence -> its first row in probs
    for i in sampling:
        local[i], n = n, n + len(drafts[i]) + 1
    draft_rows = [local[i] + j for i in sampling for j in range(len(drafts[i]))]
    draft_ids = [d for i in sampling for d in drafts[i]]
    target_p = probs[draft_rows, draft_ids].tolist() if draft_rows else []
    proposal = _proposal_probs(sampling, drafts, draft_probs)
    uniforms = _uniforms(states, drafts, sampling, generator)
    finals, final_rows, cursor = [], [], 0
    for i in sampling:
        k = len(drafts[i])
        a = k
        for j in range(k):  # accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
            q = proposal[cursor + j]
            ratio = target_p[cursor + j] / q if q > 0 else float("inf")
            if uniforms[i][j] >= ratio:
                a = j
                break
        cursor += k
        final_rows.append(local[i] + a)
        finals.append((i, a))
    dist = probs[final_rows]  # (S, V) each sequence's last row: residual or bonus
    for n, (i, a) in enumerate(finals):
        if a < len(drafts[i]):
            dist[n] = _residual(dist[n], drafts[i][a],
                                None if draft_probs is None or draft_probs[i] is None
                                else draft_probs[i][a].to(dist.device, dist.dtype))
    drawn = draw(dist, [states[i] for i, _ in finals], generator).tolist()
    for (i, a), token in zip(finals, drawn):
        tokens[i] = drafts[i][:a] + [token]


def _proposal_probs(sampling, drafts, draft_probs) -> list[float]:
    """q_j(d_j) per draft of the sampling sequences (1.0 for deterministic proposers)."""
    out = []
    for i in sampling:
        if draft_probs is None or draft_probs[i] is None:
            out.extend([1.0] * len(drafts[i]))
        else:
            q = draft_probs[i]
            out.extend(float(q[j, d]) for j, d in enumerate(drafts[i]))
    return out


def _uniforms(states, drafts, sampling, generator) -> dict[int, list[float]]:
    """One U(0, 1) per draft: from the sequence's own generator when seeded, else from
    the sampler's (one draw for all unseeded drafts)."""
    out = {}
    unseeded = [i for i in sampling if states[i].generator is None]
    shared = torch.rand(sum(len(drafts[i]) for i in unseeded), generator=generator,
                        device=generator.device).tolist()
    for i in unseeded:
        out[i], shared = shared[:len(drafts[i])], shared[len(drafts[i]):]
    for i in sampling:
        if states[i].generator is not None:
            out[i] = torch.rand(len(drafts[i]), generator=states[i].generator).tolist()
    return out


def _residual(p: torch.Tensor, rejected: int, q: torch.Tensor | None) -> torch.Tensor:
    """max(0, p - q) renormalised; q one-hot on the rejected draft when None. (V,)"""
    if q is None:
        residual = p.clone()
        residual[rejected] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    return residual / total if total > 0 else p  # p(d) ~ 1 and rejected: rounding only
