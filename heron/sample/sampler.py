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

from heron.outputs import PositionLogprobs
from heron.sample.draw import draw
from heron.sample.filters import sampling_probs
from heron.sample.logprobs import top_logprobs
from heron.sample.processing import process_logits
from heron.sample.rows import SamplingRow


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class Sampler:
    """One token per row; ``generator`` (on ``device``) serves the rows without a seed."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=torch.device(device)).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRow]) -> SamplerOutput:
        """logits: (B, V) float32 on the sampler's device, one row per request that samples."""
        raw_logprobs, logits = process_logits(logits, requests)
        tokens = logits.argmax(-1)
        sampling_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampling_rows:
            subset = [requests[i] for i in sampling_rows]
            probs = sampling_probs(logits[sampling_rows], subset)
            tokens[sampling_rows] = draw(probs, subset, self.generator)
        token_ids = tokens.tolist()  # the step's one device -> host transfer
        logprobs: list[PositionLogprobs | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if rows:
            wanted = raw_logprobs[rows].cpu()  # (len(rows), V)
            for j, i in enumerate(rows):
                logprobs[i] = top_logprobs(wanted[j], token_ids[i], requests[i].params.logprobs)
        return SamplerOutput(token_ids, logprobs)
