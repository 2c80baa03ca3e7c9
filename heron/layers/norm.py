"""RMSNorm: normalise in float32, cast back, then scale (HF Llama's order of operations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.layers.dispatch import triton_ops_enabled


class RMSNorm(nn.Module):
    """``forward(x)`` -> norm(x); ``forward(x, residual)`` -> (norm(x + residual), x + residual),
    the residual add fused into the norm kernel on the Triton path."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if triton_ops_enabled():
            from heron.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
