"""RMSNorm: normalise in float32, cast back, then scale (HF Llama's order of operations); on
CPU float32 one C++ call (``heron.kernels.cpu``), the residual add fused in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.layers.dispatch import cpu_ops_enabled, custom_kernel, triton_ops_enabled


class RMSNorm(nn.Module):
    """``forward(x)`` -> norm(x); ``forward(x, residual)`` -> (norm(x + residual), x + residual),
    the residual add fused into the norm kernel on the Triton path; a plugin op selected for
    the slot ``norm:rms_norm`` computes both forms instead."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        kernel = custom_kernel("norm:rms_norm")
        if kernel is not None:
            return kernel(x, self.weight, self.eps, residual)
        if triton_ops_enabled():
            from heron.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if cpu_ops_enabled(x) and x.dim() == 2:
            if residual is None:
                return torch.ops.heron_cpu.rms_norm(x, self.weight, self.eps)
            return torch.ops.heron_cpu.add_rms_norm(x, residual, self.weight, self.eps)
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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores ``w`` and the scale is ``1 + w``, applied in float32
    before the cast back (HF Gemma's order, unlike ``RMSNorm``'s). Same two forms as ``RMSNorm``:
    ``forward(x)`` -> norm(x), ``forward(x, residual)`` -> (norm(x + residual), x + residual).
    Normalises over the last dimension of any shape (per head for q/k norms).

    On CPU float32 it runs heron's C++ kernels with the weight ``1 + w`` (in float32 the two
    orders are the same arithmetic); elsewhere the torch formula."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        scale = 1.0 + self.weight.float()  # (hidden,)
        if cpu_ops_enabled(x):
            flat = x.reshape(-1, x.shape[-1])
            if residual is None:
                return torch.ops.heron_cpu.rms_norm(flat, scale, self.eps).view(x.shape)
            out, total = torch.ops.heron_cpu.add_rms_norm(
                flat, residual.reshape(flat.shape), scale, self.eps)
            return out.view(x.shape), total.view(x.shape)
        if residual is None:
            return self._norm(x, scale)
        x = x + residual
        return self._norm(x, scale), x

    def _norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * scale).to(x.dtype)
