"""Rotary position embedding in HF's "rotate_half" layout, fused into one Triton kernel.

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, computed in
float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.runtime import next_pow2


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct,
                   NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    mask = (offs_h < NUM_HEADS)[:, None] & d_mask[None, :]
    x_first = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_HALF)
    x2 = tl.load(x_first + HALF, mask=mask, other=0.0).to(tl.float32)
    cs = cos_ptr + token * stride_ct + offs_d
    sn = sin_ptr + token * stride_ct + offs_d
    cos1 = tl.load(cs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cs + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sn, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sn + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    out_first = out_ptr + token * (NUM_HEADS * 2 * HALF) + offs_h[:, None] * (2 * HALF) \
        + offs_d[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(out_first, (x1 * cos1 - x2 * sin1).to(ty), mask=mask)
    tl.store(out_first + HALF, (x2 * cos2 + x1 * sin2).to(ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D) (last dim contiguous), cos/sin: (T, 1, D) or (T, D), same strides
    -> rotated x, a new contiguous (T, heads, D) tensor in x's dtype."""
    num_tokens, num_heads, head_dim = x.shape
    assert head_dim % 2 == 0 and x.stride(2) == 1
    cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    assert cos.stride() == sin.stride() and cos.stride(1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0),
            NUM_HEADS=num_heads, HALF=half, BLOCK_H=next_pow2(num_heads),
            BLOCK_HALF=next_pow2(half), num_warps=4)
    return out
