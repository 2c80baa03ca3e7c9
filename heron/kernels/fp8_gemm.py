"""FP8 GEMM on tensor cores: torch._scaled_mm with row-wise scales (one per row of x, one per
output feature of the weight), as FP8 W8A8 with dynamic per-token activations needs.

torch runs it on CUDA from compute capability 8.9 (Ada, Hopper: ``scaled_mm_is_fast``) and,
slowly, on CPU, where heron's tests check the call against the emulation.
"""

from __future__ import annotations

import torch


def scaled_mm_is_fast(weight: torch.Tensor) -> bool:
    """fp8 tensor cores: CUDA compute capability 8.9 and above (Ada, Hopper)."""
    return weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (8, 9)


def scaled_mm_rowwise(xq: torch.Tensor, sx: torch.Tensor, weight_t: torch.Tensor,
                      row_scale: torch.Tensor) -> torch.Tensor:
    """fp8 xq (M, K) with scales sx ((M, 1), or one for every row) times the fp8 weight_t
    (K, N), column-major (a transposed row-major weight), with scales row_scale (N,) ->
    (M, N): bfloat16 on CUDA (the output row-wise scaling supports there), float32 on CPU."""
    m = xq.shape[0]
    scale_a = sx.reshape(-1, 1).to(torch.float32).expand(m, 1).contiguous()
    out_dtype = torch.bfloat16 if xq.is_cuda else torch.float32
    return torch._scaled_mm(xq, weight_t, scale_a=scale_a,
                            scale_b=row_scale.reshape(1, -1).to(torch.float32),
                            out_dtype=out_dtype)
