"""Pipeline stages: which decoder layers a stage owns, and what crosses between stages."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The layers of ``stage``: an even split, the first ``num_layers % num_stages`` stages
    one layer more (the last stage also runs the final norm and the LM head)."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline-parallel size {num_stages} exceeds the model's "
                         f"{num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


@dataclass
class IntermediateTensors:
    """A stage's output for the next stage: the hidden states and the residual stream,
    each (T, hidden)."""

    hidden: torch.Tensor
    residual: torch.Tensor


class MissingLayer(nn.Module):
    """Stands in for a layer another stage owns: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer belongs to another pipeline stage")
