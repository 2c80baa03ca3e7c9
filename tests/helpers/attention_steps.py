"""A mixed attention step shared by the backend tests: a decode, a chunk after a cached
prefix, a fresh prompt and a short decode over a paged cache with shuffled tables; and the
metadata of a step given as block tables and lengths (the context-parallel tests)."""

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


def table_metadata(tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                   slot_mapping: torch.Tensor, block_size: int) -> AttentionMetadata:
    """A step's metadata from its requests' block tables (padded with 0), sequence lengths
    and query lengths (queries at the end of each sequence), and the flat slot mapping."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return AttentionMetadata(slot_mapping=slot_mapping, block_tables=padded,
                             seq_lens=torch.tensor(seq_lens), query_start_loc=torch.tensor(starts),
                             query_start_loc_cpu=starts, query_lens_cpu=list(query_lens),
                             seq_lens_cpu=list(seq_lens), block_size=block_size)


def table_slots(table: list[int], start: int, count: int, block_size: int) -> list[int]:
    """The pool slots of positions start .. start + count - 1 of a sequence with ``table``."""
    return [table[p // block_size] * block_size + p % block_size
            for p in range(start, start + count)]
