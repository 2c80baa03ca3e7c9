"""Random kernel inputs (paged caches with shuffled block tables, ragged batches) and the
calls that run a kernel on them; shared by the kernel tests and ``heron check-kernels``.

Importing this module does not import triton; the ``run_*`` functions do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.kernels import reference


@dataclass
class AttentionCase:
    """A ragged batch over a paged cache: request i has queries
    ``q[query_start_loc[i]:query_start_loc[i + 1]]``, the last of its ``seq_lens[i]`` keys."""

    q: torch.Tensor  # (T, H, D)
    key_cache: torch.Tensor  # (num_blocks, block_size, KVH, D), every slot random
    value_cache: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    scale: float
    sliding_window: int | None = None

    @property
    def max_q_len(self) -> int:
        starts = self.query_start_loc
        return max(b - a for a, b in zip(starts, starts[1:]))

    def device_tensors(self):
        """query_start_loc (N + 1,), seq_lens (N,), block_tables (N, max_blocks) zero-padded."""
        dev = self.q.device
        width = max(len(t) for t in self.block_tables)
        tables = [t + [0] * (width - len(t)) for t in self.block_tables]
        return (torch.tensor(self.query_start_loc, dtype=torch.long, device=dev),
                torch.tensor(self.seq_lens, dtype=torch.long, device=dev),
                torch.tensor(tables, dtype=torch.long, device=dev))

    def reference(self) -> torch.Tensor:
        return reference.paged_attention(self.q, self.key_cache, self.value_cache,
                                         self.query_start_loc, self.seq_lens, self.block_tables,
                                         self.scale, self.sliding_window)


def attention_case(q_lens: list[int], seq_lens: list[int], num_kv_heads: int, group: int,
                   head_dim: int, block_size: int, dtype: torch.dtype, device="cpu", seed: int = 0,
                   sliding_window: int | None = None) -> AttentionCase:
    """Each request gets ``ceil(seq_len / block_size)`` blocks drawn from a shuffled pool (so
    tables are not contiguous nor ordered), plus spare blocks nobody owns."""
    assert all(q <= s for q, s in zip(q_lens, seq_lens) if s > 0), "q_len exceeds seq_len"
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used:used + n])
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    num_heads, num_tokens = num_kv_heads * group, sum(q_lens)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return AttentionCase(randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device,
                               seed=seed),
                         randn(*cache_shape, dtype=dtype, device=device, seed=seed + 1),
                         randn(*cache_shape, dtype=dtype, device=device, seed=seed + 2),
                         starts, list(seq_lens), tables, head_dim ** -0.5, sliding_window)


def run_prefill(case: AttentionCase) -> torch.Tensor:
    """The prefill kernel over every request of the case -> (T, H, D)."""
    from heron.kernels.attention_prefill import paged_prefill_attention

    starts, seq_lens, tables = case.device_tensors()
    out = torch.zeros_like(case.q)
    rows = torch.arange(len(case.seq_lens), device=case.q.device)
    paged_prefill_attention(case.q, case.key_cache, case.value_cache, out, rows, starts,
                            seq_lens, tables, case.max_q_len, case.scale, case.sliding_window)
    return out


def run_decode(case: AttentionCase, num_splits: int) -> torch.Tensor:
    """The split-KV decode kernel on a case whose requests all have one query -> (B, H, D)."""
    from heron.kernels.attention_decode import paged_decode_attention

    assert case.max_q_len == 1
    _, seq_lens, tables = case.device_tensors()
    out = torch.zeros_like(case.q)
    paged_decode_attention(case.q, case.key_cache, case.value_cache, out, seq_lens, tables,
                           case.scale, num_splits, case.sliding_window)
    return out


def run_cpu_attention(case: AttentionCase) -> torch.Tensor:
    """heron's C++ paged attention (any mix of query lengths) over the case -> (T, H, D).
    Needs ``heron.kernels.cpu.load()`` first; the case lives on the CPU."""
    starts, seq_lens, tables = case.device_tensors()
    return torch.ops.heron_cpu.paged_attention(case.q, case.key_cache, case.value_cache, tables,
                                               seq_lens, starts, case.scale,
                                               case.sliding_window or 0)


def randn(*shape: int, dtype: torch.dtype, device="cpu", seed: int = 0) -> torch.Tensor:
    """N(0, 1) drawn on ``device`` (large real-shape caches never touch the host)."""
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)
