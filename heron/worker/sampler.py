"""Turn a batch of float32 logits into next tokens (and logprobs), one row per request.

Order of operations per row: raw logprobs (what is reported) -> penalties -> min_tokens
masking -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> sample.
Seeded requests draw from their own generator, so their output does not depend on the batch.
Everything runs on the logits' device; which filters apply is decided from the requests'
parameters on the host, so the only device-to-host transfer is the final token ids (and the
rows of logprobs that were asked for).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.worker.input_batch import SequenceState
from heron.outputs import PositionLogprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


def top_logprobs(logprobs: torch.Tensor, token_ids: int | torch.Tensor,
                 k: int) -> PositionLogprobs:
    """logprobs (V,) of one position -> {token: (logprob, rank)} for the chosen token and top-k."""
    chosen = int(token_ids)
    chosen_lp = logprobs[chosen]
    result = {chosen: (float(chosen_lp), int((logprobs > chosen_lp).sum()) + 1)}
    if k > 0:
        values, ids = logprobs.topk(k)
        for rank, (lp, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            result.setdefault(tid, (lp, rank))
    return result


# Repetition penalties below this act as it: dividing float32 logits by less overflows to inf
# (and a zero logit to NaN), while the penalised tokens already dominate at this value.
MIN_REPETITION_PENALTY = 1e-4


def _apply_penalties(logits: torch.Tensor, requests: list[SequenceState]) -> None:
    """In place. Repetition penalty over prompt + output (HF semantics); presence and
    frequency penalties over output tokens only (OpenAI semantics)."""
    vocab = logits.shape[-1]
    for row, req in enumerate(requests):
        p = req.params
        if not p.uses_penalties:
            continue
        if p.repetition_penalty != 1.0:
            penalty = max(p.repetition_penalty, MIN_REPETITION_PENALTY)
            seen = torch.tensor(sorted(set(req.all_token_ids())), dtype=torch.long,
                                device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
        if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=vocab)
            counts = counts[:vocab].to(logits.device, logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _mask_min_tokens(logits: torch.Tensor, requests: list[SequenceState]) -> None:
    for row, req in enumerate(requests):
        if req.num_output_tokens < req.params.min_tokens:
            banned = list(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                banned.extend(req.eos_token_ids)
            if banned:
                logits[row, banned] = float("-inf")


def process_logits(logits: torch.Tensor, requests: list
                   ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(raw logprobs if any row asks for logprobs, else None; float32 logits after the
    penalties and min_tokens masking), one row per entry of ``requests``."""
    logits = logits.float()
    raw_logprobs = None
    if any(r.params.logprobs is not None for r in requests):
        raw_logprobs = logits.log_softmax(-1)
    if any(r.params.uses_penalties or r.params.min_tokens for r in requests):
        logits = logits.clone()
        _apply_penalties(logits, requests)
        _mask_min_tokens(logits, requests)
    return raw_logprobs, logits


def _filter(logits: torch.Tensor, requests: list[SequenceState]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on rows that sample; returns probabilities."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype, device=dev)
    logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[-1]
    top_ks = [min(r.params.top_k or vocab, vocab) for r in requests]
    top_ps = [r.params.top_p for r in requests]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        top_k = torch.tensor(top_ks, device=dev)
        top_p = torch.tensor(top_ps, dtype=logits.dtype, device=dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= mass_before > top_p.unsqueeze(1)  # keeps at least the top token
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    if any(r.params.min_p > 0 for r in requests):
        min_p = torch.tensor([r.params.min_p for r in requests], dtype=probs.dtype, device=dev)
        threshold = min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, requests: list[SequenceState], generator: torch.Generator):
    """Exponential-race sampling: argmax(p / E), E ~ Exp(1), one draw per row.

    ``generator`` lives on the probabilities' device; a request's own generator lives on the
    CPU (so a seed gives the same tokens on any device), its noise copied over when needed.
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(requests) if r.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device
                                      ).exponential_(generator=generator)
    for i, r in enumerate(requests):
        if r.generator is None:
            continue
        if r.generator.device == probs.device:
            noise[i].exponential_(generator=r.generator)
        else:
            noise[i] = torch.empty(probs.shape[1]).exponential_(generator=r.generator).to(
                probs.device, non_blocking=True)
    return (probs / noise).argmax(-1)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=torch.device(device)).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[SequenceState]) -> SamplerOutput:
        """logits: (B, V) float32 on the sampler's device, one row per request that samples."""
        raw_logprobs, logits = process_logits(logits, requests)
        tokens = logits.argmax(-1)
        sampling_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampling_rows:
            subset = [requests[i] for i in sampling_rows]
            probs = _filter(logits[sampling_rows], subset)
            tokens[sampling_rows] = _draw(probs, subset, self.generator)
        token_ids = tokens.tolist()  # the step's one device -> host transfer
        logprobs: list[PositionLogprobs | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if rows:
            wanted = raw_logprobs[rows].cpu()  # (len(rows), V)
            for j, i in enumerate(rows):
                logprobs[i] = top_logprobs(wanted[j], token_ids[i], requests[i].params.logprobs)
        return SamplerOutput(token_ids, logprobs)
