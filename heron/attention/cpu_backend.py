"""CPU attention with heron's C++ paged decode kernel (``heron/kernels/cpu``).

Decode queries read K/V straight from the paged pool, one page at a time (online softmax),
instead of gathering each sequence's pages into a padded tensor in every layer: at 64
sequences of ~700 tokens that gather copied ~2 GB per step. Prefill chunks take the torch
reference path (their copy is amortised over the chunk's queries). Same metadata and results
as ``torch`` (the oracle it is tested against).
"""

from __future__ import annotations

import torch

from heron.attention.torch_backend import TorchAttentionBackend, _DecodePlan


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    @staticmethod
    def _decode(q, key_cache, value_cache, plan: _DecodePlan, scale, sliding_window):
        # q: (B, H, D); caches: (num_blocks, block_size, KVH, D) -> (B, H, D)
        return torch.ops.heron_cpu.paged_decode_attention(
            q, key_cache, value_cache, plan.block_tables, plan.seq_lens, scale,
            sliding_window or 0)
