"""Weight-only quantized GEMM in Triton (CUDA): y = x @ W^T for a ``GroupedIntWeight`` W
(``heron.kernels.int_pack``), dequantized tile by tile in registers, never in memory.

W's values are uint8, one per byte (5..8 bits) or two per byte (<= 4 bits: in each chunk of
64 input features, 32 bytes, byte 4j + b holds feature 16b + j in its low nibble and
16b + 8 + j in its high one); ``w[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]``. Each program computes a
(BLOCK_M, BLOCK_N) tile of y, accumulating in float32 over BLOCK_K slices of the input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.attention_common import dot
from heron.kernels.runtime import dot_in_fp32


@triton.jit
def _grouped_int_gemm_kernel(x_ptr, q_ptr, scales_ptr, mins_ptr, y_ptr, M, N, K, stride_xm,
                             row_bytes, num_groups, GROUP: tl.constexpr, PACKED: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # (BM, BK)
        w_mask = n_mask[:, None] & k_mask[None, :]
        if PACKED:  # two 4-bit values per byte, in chunks of 64 (see the module docstring)
            within = offs_k % 64
            byte = (offs_k // 64) * 32 + (within % 8) * 4 + within // 16
            shift = ((within // 8) % 2) * 4
            raw = tl.load(q_ptr + rows * row_bytes + byte[None, :], mask=w_mask, other=0)
            q = (raw.to(tl.int32) >> shift[None, :]) & 0xF
        else:
            q = tl.load(q_ptr + rows * row_bytes + offs_k[None, :], mask=w_mask,
                        other=0).to(tl.int32)
        group = rows * num_groups + (offs_k // GROUP)[None, :]
        s = tl.load(scales_ptr + group, mask=w_mask, other=0.0)
        mn = tl.load(mins_ptr + group, mask=w_mask, other=0.0)
        w = q.to(tl.float32) * s + mn  # (BN, BK)
        acc += dot(x, tl.trans(w.to(x.dtype)), DOT_FP32)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


def grouped_int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    """x (M, K) float32 / bfloat16 / float16 -> float32 (M, N)."""
    m, k = x.shape
    n = qweight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _grouped_int_gemm_kernel[grid](x, qweight, scales, mins, y, m, n, k, x.stride(0),
                                   qweight.shape[1], scales.shape[1], GROUP=group_size,
                                   PACKED=bits <= 4, BLOCK_M=block_m, BLOCK_N=block_n,
                                   BLOCK_K=block_k, DOT_FP32=dot_in_fp32(x.dtype))
    return y
