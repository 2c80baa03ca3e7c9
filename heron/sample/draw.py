"""One token per row from probabilities, by exponential race: argmax(p / E), E ~ Exp(1).
Seeded rows draw from their own generator, so their tokens do not depend on the batch."""

from __future__ import annotations

import torch

from heron.sample.rows import SamplingRow


def draw(probs: torch.Tensor, requests: list[SamplingRow],
         generator: torch.Generator) -> torch.Tensor:
    """probs (R, V) -> token ids (R,) on the probabilities' device.

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
