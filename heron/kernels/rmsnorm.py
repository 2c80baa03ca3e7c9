"""Fused RMSNorm, optionally with the residual add before it, in Triton.

Computes ``weight * x / sqrt(mean(x^2) + eps)`` in float32 and rounds once to the input dtype.
HF Llama (and the torch path in ``heron.layers.norm``) rounds the normalised value to the input
dtype before the weight; in float32 that is the same, in half precision this kernel is within
one rounding of it and closer to the exact result. With a residual, ``x + residual`` is also
returned, rounded to the input dtype (the residual stream's dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.runtime import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
                     stride_x, stride_r, N: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * N + offs,
                 h.to(residual_out_ptr.dtype.element_ty), mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (h * inv_rms * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x (and residual): (..., N) -> ``norm(x)``, or ``(norm(x + residual), x + residual)``
    when a residual is given. Outputs are new contiguous tensors in x's dtype."""
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    residual_out = torch.empty_like(out) if residual is not None else out
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, residual_out, eps, x2.stride(0), r2.stride(0),
            N=n, BLOCK=next_pow2(n), HAS_RESIDUAL=residual is not None,
            num_warps=4 if n <= 2048 else 8)
    if residual is None:
        return out.view(shape)
    return out.view(shape), residual_out.view(shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (rows, N) with unit stride along N (a copy only when needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()
