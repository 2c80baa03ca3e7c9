"""Paged decode attention with split-KV (flash-decoding), in Triton.

One query per sequence. Stage 1: program ``(seq, kv_head, split)`` attends the ``group``
query heads that share the KV head to one contiguous slice of the context, writing a
normalised partial output and its log2-sum-exp. Stage 2: program ``(seq, head)`` merges the
splits. The number of splits is a launch constant chosen from the batch shape alone, and each
sequence cuts its own context into that many slices on the device, so the launch never reads
sequence lengths on the host: it can be captured in a CUDA graph and replayed for other
lengths. Rows with ``seq_len == 0`` (graph padding) produce zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from heron.kernels.attention_common import dot, kv_tile_offsets, online_softmax_step
from heron.kernels.runtime import dot_in_fp32, next_pow2

MAX_SPLITS = 32


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Enough splits for about two programs per SM, at most MAX_SPLITS (a power of two)."""
    splits = 1
    while splits < MAX_SPLITS and batch * num_kv_heads * splits < 2 * num_sms:
        splits *= 2
    return splits


@triton.jit
def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
        seq_lens_ptr, block_tables_ptr, scale_log2, window, num_splits,
        stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0  # first visible key: the window keeps keys > (seq_len - 1) - window
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # (BLOCK_H,) query heads of this KV head
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
                + offs_d[None, :], mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n_start in range(start, end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        kv_off = kv_tile_offsets(table_row, offs_n, n_mask, kv_head, stride_cb, stride_cs,
                                 stride_ch, BLOCK_SIZE)
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        s = dot(q, k, DOT_FP32) * scale_log2  # (BLOCK_H, BLOCK_N)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32)

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    # partials: out (B, H, S, D), lse (B, H, S), contiguous
    part = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # (BLOCK_H,)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=h_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + part, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                         stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))  # (BLOCK_S,)
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # 0 for empty
    part = tl.load(part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * part, 0) / tl.where(total > 0, total, 1.0)  # (BLOCK_D,)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           out: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           scale: float, num_splits: int,
                           sliding_window: int | None = None) -> None:
    """One query per sequence, written into ``out`` (in place).

    q, out: (B, H, D) (last dim contiguous); key_cache, value_cache:
    (num_blocks, block_size, KVH, D); seq_lens: (B,) keys per sequence, the query being the
    last; block_tables: (B, max_blocks). Reads nothing from the device on the host.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    assert q.stride(2) == 1 and out.stride(2) == 1 and key_cache.stride(3) == 1
    assert key_cache.stride() == value_cache.stride() and num_heads % num_kv_heads == 0
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, key_cache, value_cache, part_out, part_lse, seq_lens, block_tables,
        scale * math.log2(math.e), sliding_window or 0, num_splits,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_H=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=64, USE_WINDOW=sliding_window is not None,
        DOT_FP32=dot_in_fp32(q.dtype), num_warps=4)
    _decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, next_pow2(num_splits)), num_warps=4)
