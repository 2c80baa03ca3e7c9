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

Tree requests (``md.tree_masks``, more than one query) are the exception: the kernel knows
only causal masks, so they go through the torch backend's masked prefill one by one, and
the other requests through one kernel call on the sub-batch without them. A step without
trees makes the same single kernel call as always.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.attention.metadata import AttentionMetadata
from heron.attention.torch_backend import TorchAttentionBackend, tree_attn_mask


@dataclass
class _TreeSplit:
    """One step's split: tree requests for the torch path, the rest for the kernel."""

    trees: list[int]  # request indices with a tree mask and more than one query
    rest_tokens: torch.Tensor  # (T_rest,) flat token indices of the other requests
    rest_tables: torch.Tensor  # (R_rest, max_blocks)
    rest_seq_lens: torch.Tensor  # (R_rest,)
    rest_starts: torch.Tensor  # (R_rest + 1,) query_start_loc of the sub-batch


def _tree_split(md: AttentionMetadata, trees: list[int]) -> _TreeSplit:
    tree_set = set(trees)
    rest = [i for i in range(md.num_reqs) if i not in tree_set]
    starts, tokens = [0], []
    for i in rest:
        first, q_len = md.query_start_loc_cpu[i], md.query_lens_cpu[i]
        tokens.extend(range(first, first + q_len))
        starts.append(starts[-1] + q_len)
    idx = torch.tensor(rest, dtype=torch.long)
    return _TreeSplit(trees, torch.tensor(tokens, dtype=torch.long), md.block_tables[idx],
                      md.seq_lens[idx], torch.tensor(starts, dtype=torch.long))


class CpuAttentionBackend:
    name = "cpu"

    def forward(self, q, k, v, kv_cache, md: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D); kv_cache: (2, num_blocks, block_size, KVH, D).

        Writes k, v into their slots (as the torch backend does), then returns the attention
        output (T, H, D), contiguous.
        """
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        torch.ops.heron_cpu.write_kv(k, v, key_cache, value_cache, md.slot_mapping)
        if md.tree_masks and md.tree_rows(sliding_window):
            return self._forward_with_trees(q, key_cache, value_cache, md, scale)
        # request i: queries query_start_loc[i]:[i + 1], the last of its seq_lens[i] tokens
        return torch.ops.heron_cpu.paged_attention(
            q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
            sliding_window or 0)

    @staticmethod
    def _forward_with_trees(q, key_cache, value_cache, md: AttentionMetadata, scale: float):
        if "cpu_tree_split" not in md.backend_cache:
            md.backend_cache["cpu_tree_split"] = _tree_split(md, md.tree_rows())
        split = md.backend_cache["cpu_tree_split"]
        out = torch.empty(q.shape, dtype=q.dtype)  # (T, H, D), contiguous
        if split.rest_tokens.numel():
            out[split.rest_tokens] = torch.ops.heron_cpu.paged_attention(
                q[split.rest_tokens], key_cache, value_cache, split.rest_tables,
                split.rest_seq_lens, split.rest_starts, scale, 0)
        for i in split.trees:  # no sliding window here (tree_rows refuses it)
            start, q_len = md.query_start_loc_cpu[i], md.query_lens_cpu[i]
            out[start:start + q_len] = TorchAttentionBackend._prefill(
                q[start:start + q_len], key_cache, value_cache, md.block_tables[i],
                md.seq_lens_cpu[i], md.block_size, scale, None, tree_attn_mask(md, i, q.device))
        return out
