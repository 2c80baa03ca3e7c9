"""KV-cache store ("reshape and cache"): write each token's K and V into its slot, in Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.runtime import next_pow2


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:  # padding token (CUDA-graph batches): nothing to store
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
        + offs_h[:, None] * stride_ch + offs_d[None, :]  # (BLOCK_H, BLOCK_D)
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: (T, KVH, D) (last dim contiguous); caches: (num_blocks, block_size, KVH, D);
    slot_mapping: (T,) int64, flat slot ``block * block_size + offset``, negative = skip."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.dtype == key_cache.dtype and v.dtype == value_cache.dtype
    assert k.stride(2) == 1 and v.stride(2) == 1 and key_cache.stride(3) == 1
    assert key_cache.stride() == value_cache.stride()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=key_cache.shape[1], num_warps=4)
