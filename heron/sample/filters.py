"""From processed logits to the distribution a sampling row draws from: temperature, then
top-k, top-p and min-p. Which filters run is decided from the rows' parameters on the host."""

from __future__ import annotations

import torch

from heron.sample.rows import SamplingRow


def sampling_probs(logits: torch.Tensor, requests: list[SamplingRow]) -> torch.Tensor:
    """logits (R, V) float32 of rows that sample (temperature > 0) -> probabilities (R, V)
    after temperature, top-k, top-p and min-p."""
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
