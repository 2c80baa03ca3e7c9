"""Linear layers that know how to load their checkpoint tensors.

A module's ``load_weight(param, tensor, shard_id)`` copies a checkpoint tensor into one of its
parameters; fused layers (qkv, gate_up) load each HF projection into its row range. (The hook
lives on the module, not the parameter, so it survives ``to_empty`` after meta construction.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(tensor.shape)}")
    param.data.copy_(tensor)


def _make_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); W: (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _make_param(out_features, in_features)
        self.bias = _make_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul.

    ``output_sizes[i]`` rows of the weight belong to shard ``i``; the checkpoint tensor of
    shard ``i`` is loaded into exactly those rows.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        offsets = [0]
        for size in output_sizes:
            offsets.append(offsets[-1] + size)
        self.offsets = offsets

    def load_weight(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: int) -> None:
        start, end = self.offsets[shard_id], self.offsets[shard_id + 1]
        default_weight_loader(param.data[start:end], tensor)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.output_sizes, dim=-1))
