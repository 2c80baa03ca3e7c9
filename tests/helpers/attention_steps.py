"""A mixed attention step shared by the backend tests: a decode, a chunk after a cached
prefix, a fresh prompt and a short decode over a paged cache with shuffled tables."""

from __future__ import annotations

import torch

from heron.attention import AttentionMetadata
from heron.kernels import cases


def mixed_step(sliding_window):
    """Block size 4, 2 KV heads x 4, head_dim 64. Returns (q, k, v, kv_cache, metadata)."""
    q_lens, seq_lens = [1, 7, 12, 1], [30, 20, 12, 5]
    case = cases.attention_case(q_lens, seq_lens, 2, 4, 64, 4, torch.float32, seed=11,
                                sliding_window=sliding_window)
    starts, seq_lens_t, tables = case.device_tensors()
    slots = [case.block_tables[i][p // 4] * 4 + p % 4
             for i, (q, s) in enumerate(zip(q_lens, seq_lens)) for p in range(s - q, s)]
    k = cases.randn(sum(q_lens), 2, 64, dtype=torch.float32, seed=12)
    v = cases.randn(sum(q_lens), 2, 64, dtype=torch.float32, seed=13)
    md = AttentionMetadata(torch.tensor(slots), tables, seq_lens_t, starts,
                           case.query_start_loc, q_lens, seq_lens, block_size=4)
    kv_cache = torch.stack([case.key_cache, case.value_cache])
    return case.q, k, v, kv_cache, md
