"""Triton building blocks shared by the prefill and decode attention kernels.

The paged KV layout per layer is ``(2, num_blocks, block_size, num_kv_heads, head_dim)``; the
kernels get the key and value halves separately, with their strides. Key position ``p`` of a
request lives in block ``block_table[p // block_size]`` at offset ``p % block_size``, so block
tables may be in any order. Scores are kept in the log2 domain (``scale * log2(e)`` folded
into the scale) so the softmax uses ``exp2``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b with float32 accumulation; IEEE float32 operands when DOT_FP32."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def kv_tile_offsets(block_table_row_ptr, offs_n, n_mask, kv_head, stride_cb, stride_cs,
                    stride_ch, BLOCK_SIZE: tl.constexpr):
    """(BLOCK_N,) element offsets of key positions ``offs_n`` of one KV head in the cache."""
    block = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    return block.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32: tl.constexpr):
    """Fold one tile of log2-scaled scores ``s`` (M, N; -inf where masked) and values ``v``
    (N, D) into the running max ``m_i`` (M,), sum ``l_i`` (M,) and output ``acc`` (M, D).

    Rows whose scores are all -inf so far keep m = -inf; they use 0 as the reference so that
    no ``-inf - -inf`` NaN appears.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)  # (M,) rescales what was accumulated so far
    p = tl.exp2(s - m_ref[:, None])  # (M, N)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = dot(p, v, DOT_FP32)
    else:
        pv = dot(p.to(v.dtype), v, DOT_FP32)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
