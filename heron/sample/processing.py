"""Logit processing before a choice: the raw logprobs (what is reported), then the
penalties and min_tokens masking, one row of logits per ``SamplingRow``."""

from __future__ import annotations

import torch

from heron.sample.rows import SamplingRow

# Repetition penalties below this act as it: dividing float32 logits by less overflows to inf
# (and a zero logit to NaN), while the penalised tokens already dominate at this value.
MIN_REPETITION_PENALTY = 1e-4


def _apply_penalties(logits: torch.Tensor, requests: list[SamplingRow]) -> None:
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


def _mask_min_tokens(logits: torch.Tensor, requests: list[SamplingRow]) -> None:
    for row, req in enumerate(requests):
        if req.num_output_tokens < req.params.min_tokens:
            banned = list(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                banned.extend(req.eos_token_ids)
            if banned:
                logits[row, banned] = float("-inf")


def process_logits(logits: torch.Tensor, requests: list[SamplingRow]
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
