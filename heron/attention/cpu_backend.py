"""CPU attention with heron's C++ paged attention kernel (``heron/kernels/cpu``).

Every query of a step, decodes and prefill chunks in any mix, goes through one call of
``torch.ops.heron_cpu.paged_attention``, which reads K/V straight from the paged pool one
page at a time (online softmax) instead of gathering each sequence's pages into a padded
tensor in every layer (at 64 sequences of ~700 tokens that gather copied ~2 GB per decode
step). Prefill chunks are tiled: 96 (query, head) rows of one request and one KV head's GQA
group share every key and value load. Measured against the torch reference path (gather +
SDPA) in ``benchmarks/cpu_prefill_attention.py``: faster on every shape measured there, so
no chunk is routed back to it. Same metadata and results as ``torch`` (the oracle it is
tested against).
"""

from __future__ import annotations

import torch

from heron.attention.metadata import AttentionMetadata


class CpuAttentionBackend:
    name = "cpu"

    def forward(self, q, k, v, kv_cache, md: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D); kv_cache: (2, num_blocks, block_size, KVH, D).

        Writes k, v into their slots (as the torch backend does), then returns the attention
        output (T, H, D), contiguous.
        """
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v)
        # request i: queries query_start_loc[i]:[i + 1], the last of its seq_lens[i] tokens
        return torch.ops.heron_cpu.paged_attention(
            q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
            sliding_window or 0)
