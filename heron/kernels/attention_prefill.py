"""Prefill / extend attention over the paged KV cache (FlashAttention-2 style, Triton).

Each program computes one tile of ``BLOCK_M`` queries of one request and one query head. The
request's queries are its last ``q_len`` positions (a prefix of ``seq_len - q_len`` tokens
may already be in the cache); keys are read page by page through the block table, tile by
tile of ``BLOCK_N``, with an online softmax in float32. Causal, GQA (query head ``h`` reads KV
head ``h // group``), optional sliding window. The new tokens' K/V must already be stored.

Optional tree masks (speculative tree verification): a request with a mask sees its whole
prefix and, among its ``q_len`` new keys, key ``b`` for query ``a`` iff
``mask[a * q_len + b]`` is nonzero, read from one flat packed int8 tensor at the request's
offset (-1: no mask, causal). Such a request scans all its new keys (nodes need not be in
topological order).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from heron.kernels.attention_common import dot, kv_tile_offsets, online_softmax_step
from heron.kernels.runtime import dot_in_fp32, next_pow2


@triton.jit
def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        rows_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
        tree_mask_ptr, tree_offsets_ptr, scale_log2, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_TREE: tl.constexpr, DOT_FP32: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0))  # request index in the flat batch
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_start
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    prefix = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)  # query index within the request
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    q_pos = prefix + offs_m  # (BLOCK_M,) absolute positions

    hi = prefix + tl.minimum(m_start + BLOCK_M, q_len)  # causal: keys < last query pos + 1
    lo = 0
    if USE_TREE:
        tree_off = tl.load(tree_offsets_ptr + row)  # this request's (q_len, q_len) mask, or -1
        tree_base = tree_mask_ptr + tl.maximum(tree_off, 0)
        # keys from tree_first on are decided by the mask: the new keys, none without a mask
        tree_first = tl.where(tree_off >= 0, prefix, seq_len)
        hi = tl.where(tree_off >= 0, seq_len, hi)  # an ancestor may come after its node
    if USE_WINDOW:
        lo = tl.maximum(prefix + m_start - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + row * stride_bt
    for n_start in range(lo, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        kv_off = kv_tile_offsets(table_row, offs_n, n_mask, kv_head, stride_cb, stride_cs,
                                 stride_ch, BLOCK_SIZE)  # (BLOCK_N,)
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        s = dot(q, k, DOT_FP32) * scale_log2  # (BLOCK_M, BLOCK_N)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        if USE_TREE:
            new_key = (offs_n >= tree_first) & n_mask  # (BLOCK_N,) keys the mask decides
            bit = tl.load(tree_base + offs_m[:, None] * q_len + (offs_n - prefix)[None, :],
                          mask=m_mask[:, None] & new_key[None, :], other=0)
            visible = tl.where(new_key[None, :], bit != 0, visible)
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            out: torch.Tensor, rows: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, block_tables: torch.Tensor, max_q_len: int,
                            scale: float, sliding_window: int | None = None,
                            tree_mask: torch.Tensor | None = None,
                            tree_offsets: torch.Tensor | None = None) -> None:
    """Attention for the requests listed in ``rows``, written into ``out`` (in place).

    q, out: (T, H, D) flat batch (last dim contiguous); key_cache, value_cache:
    (num_blocks, block_size, KVH, D); rows: (R,) request indices; query_start_loc: (N + 1,);
    seq_lens: (N,); block_tables: (N, max_blocks); max_q_len bounds the rows' query lengths.
    tree_mask: (sum of q_len^2 over tree requests,) int8, each request's (q_len, q_len) mask
    row-major; tree_offsets: (N,) int64, where request i's mask starts, -1 for none. Both or
    neither; not with a sliding window.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    assert q.stride(2) == 1 and out.stride(2) == 1 and key_cache.stride(3) == 1
    assert key_cache.stride() == value_cache.stride() and num_heads % num_kv_heads == 0
    assert (tree_mask is None) == (tree_offsets is None)
    assert tree_mask is None or sliding_window is None, "tree masks take no sliding window"
    if rows.numel() == 0 or max_q_len == 0:
        return
    use_tree = tree_mask is not None
    if not use_tree:  # unused pointers: any tensor of the device
        tree_mask = tree_offsets = seq_lens
    block_m = 16 if max_q_len <= 16 else 64
    grid = (rows.numel(), num_heads, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](
        q, key_cache, value_cache, out, rows, query_start_loc, seq_lens, block_tables,
        tree_mask, tree_offsets, scale * math.log2(math.e), sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_M=block_m, BLOCK_N=64,
        USE_WINDOW=sliding_window is not None, USE_TREE=use_tree, DOT_FP32=dot_in_fp32(q.dtype),
        num_warps=4)
