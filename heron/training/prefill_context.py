"""A forward context for a one-off prefill of whole sequences, outside the engine.

Used to run a heron model (the target, or an EAGLE head) over complete token sequences with
the reference torch attention backend: each sequence gets fresh, consecutive KV blocks of a
private cache, no prefix is cached, and every token is a query (a prefill of the whole
sequence). Sequence ``i`` owns flat rows ``sum(seq_lens[:i]) : sum(seq_lens[:i + 1])``.
"""

from __future__ import annotations

import torch

from heron.attention.metadata import AttentionMetadata, ForwardContext
from heron.attention.torch_backend import TorchAttentionBackend


def prefill_metadata(seq_lens: list[int], block_size: int = 16,
                     device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata of one step that prefills every sequence of ``seq_lens`` from position 0.

    Sequence ``i`` gets blocks ``[first_i, first_i + ceil(len_i / block_size))``, so token
    ``j`` of it sits in slot ``first_i * block_size + j``; the pool needs
    ``num_blocks(seq_lens, block_size)`` blocks."""
    device = torch.device(device)
    blocks = [-(-n // block_size) for n in seq_lens]
    first = [sum(blocks[:i]) for i in range(len(blocks))]
    slots = torch.cat([f * block_size + torch.arange(n) for f, n in zip(first, seq_lens)])
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.long)
    for i, (f, nb) in enumerate(zip(first, blocks)):
        tables[i, :nb] = torch.arange(f, f + nb)
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
        query_start_loc_cpu=starts, query_lens_cpu=list(seq_lens),
        seq_lens_cpu=list(seq_lens), block_size=block_size)


def num_blocks(seq_lens: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in seq_lens)


def prefill_context(seq_lens: list[int], num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    block_size: int = 16) -> ForwardContext:
    """A torch-backend forward context prefilling ``seq_lens`` with zeroed KV caches, one per
    layer: (2, num_blocks, block_size, num_kv_heads, head_dim)."""
    shape = (2, num_blocks(seq_lens, block_size), block_size, num_kv_heads, head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return ForwardContext(attn_metadata=prefill_metadata(seq_lens, block_size, device),
                          kv_caches=caches, backend=TorchAttentionBackend())
