"""Random weights for a model built from its config alone (``load_format="dummy"``).

Throughput and latency depend on shapes, not on values, so large models can be benchmarked
without downloading their checkpoints. Norm scales are set to 1 and biases to 0 so that
activations keep the magnitudes of a trained model; matrices are drawn from N(0, std).
"""

from __future__ import annotations

import torch
from torch import nn

from heron.layers.norm import RMSNorm

DUMMY_STD = 0.02


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Overwrite every parameter of ``model`` in place, deterministically for a given seed
    and device. Tied parameters are filled once (they are the same tensor)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, RMSNorm):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
