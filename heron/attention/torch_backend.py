"""Reference attention over the paged KV cache in plain torch (CPU and the test oracle).

Decodes (query length 1) are batched into one SDPA call over their gathered, padded
contexts; each prefill chunk gets its own call with a causal mask offset by its cached prefix.
Handles GQA, any mix of prefill chunks and decodes, and optional sliding windows. A tree
request (``md.tree_masks``, more than one query) takes the prefill call with its tree mask
(``tree_attn_mask``); one with a single query is an ordinary decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from heron.attention.metadata import AttentionMetadata


@dataclass
class _DecodePlan:
    token_idx: torch.Tensor  # (num_decodes,) flat token index of each decode query
    block_tables: torch.Tensor  # (num_decodes, max_blocks)
    key_pos: torch.Tensor  # (num_decodes, max_blocks * block_size) key positions
    seq_lens: torch.Tensor  # (num_decodes,)
    masks: dict = field(default_factory=dict)  # sliding window -> (B, 1, 1, L) bool mask

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Built once per step and window size, shared by every layer."""
        if sliding_window not in self.masks:
            query_pos = (self.seq_lens - 1).view(-1, 1)
            self.masks[sliding_window] = _window_mask(self.key_pos, query_pos,
                                                      sliding_window).unsqueeze(1)
        return self.masks[sliding_window]


def _decode_plan(md: AttentionMetadata) -> _DecodePlan | None:
    rows = [i for i, q in enumerate(md.query_lens_cpu) if q == 1]
    if not rows:
        return None
    idx = torch.tensor(rows, dtype=torch.long, device=md.seq_lens.device)
    max_len = max(md.seq_lens_cpu[i] for i in rows)
    num_blocks = -(-max_len // md.block_size)
    key_pos = torch.arange(num_blocks * md.block_size, device=idx.device)
    return _DecodePlan(
        token_idx=md.query_start_loc[idx],
        block_tables=md.block_tables[idx, :num_blocks],
        key_pos=key_pos.expand(len(rows), -1),
        seq_lens=md.seq_lens[idx],
    )


def _window_mask(key_pos: torch.Tensor, query_pos: torch.Tensor, sliding_window: int | None):
    """Boolean mask (..., num_queries, num_keys): key visible to query (causal + window)."""
    mask = key_pos.unsqueeze(-2) <= query_pos.unsqueeze(-1)
    if sliding_window is not None:
        mask &= key_pos.unsqueeze(-2) > query_pos.unsqueeze(-1) - sliding_window
    return mask


def tree_attn_mask(md: AttentionMetadata, i: int, device: torch.device) -> torch.Tensor:
    """(Q_i, seq_lens[i]) bool SDPA mask of tree request ``i``: every context key visible, then
    its tree mask over the Q_i new keys. Built once per step (cached in md.backend_cache)."""
    cache = md.backend_cache.setdefault("tree_attn_masks", {})
    if i not in cache:
        tree = md.tree_masks[i]
        q_len, seq_len = tree.shape[0], md.seq_lens_cpu[i]
        mask = torch.ones(q_len, seq_len, dtype=torch.bool)
        mask[:, seq_len - q_len:] = tree
        cache[i] = mask.to(device)
    return cache[i]


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, kv_cache, md: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D); kv_cache: (2, num_blocks, block_size, KVH, D).

        Writes k, v into their slots, then returns the attention output (T, H, D).
        """
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v)

        out = torch.empty_like(q)
        if "decode" not in md.backend_cache:
            md.backend_cache["decode"] = _decode_plan(md)
        plan = md.backend_cache["decode"]
        if plan is not None:
            out[plan.token_idx] = self._decode(q[plan.token_idx], key_cache, value_cache,
                                               plan, scale, sliding_window)
        trees = md.tree_rows(sliding_window)  # [] without tree masks
        for i, q_len in enumerate(md.query_lens_cpu):
            if q_len > 1:
                start = md.query_start_loc_cpu[i]
                mask = tree_attn_mask(md, i, q.device) if i in trees else None
                out[start:start + q_len] = self._prefill(
                    q[start:start + q_len], key_cache, value_cache, md.block_tables[i],
                    md.seq_lens_cpu[i], md.block_size, scale, sliding_window, mask)
        return out

    @staticmethod
    def _decode(q, key_cache, value_cache, plan: _DecodePlan, scale, sliding_window):
        # q: (B, H, D) -> (B, H, 1, D); keys gathered from the block tables: (B, KVH, L, D)
        keys = key_cache[plan.block_tables].flatten(1, 2).transpose(1, 2)
        values = value_cache[plan.block_tables].flatten(1, 2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                             attn_mask=plan.mask(sliding_window), scale=scale,
                                             enable_gqa=True)
        return out.squeeze(2)

    @staticmethod
    def _prefill(q, key_cache, value_cache, block_table, seq_len, block_size, scale,
                 sliding_window, mask=None):
        # q: (Q, H, D) for the last Q positions of a sequence of seq_len tokens; mask: an
        # explicit (Q, seq_len) bool mask (a tree's) replacing the causal / window one.
        q_len = q.shape[0]
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[:num_blocks]
        group = q.shape[1] // key_cache.shape[2]
        # (1, H, L, D): KV heads repeated for GQA and a batch dim, because only 4-D inputs
        # without enable_gqa reach the fused CPU kernel (~8x faster than the math path at 2k)
        keys = key_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        values = value_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        keys = keys.repeat_interleave(group, 0).unsqueeze(0)
        values = values.repeat_interleave(group, 0).unsqueeze(0)
        qt = q.transpose(0, 1).unsqueeze(0)  # (1, H, Q, D)
        if mask is not None:
            out = F.scaled_dot_product_attention(qt, keys, values, attn_mask=mask, scale=scale)
        elif q_len == seq_len and sliding_window is None:
            out = F.scaled_dot_product_attention(qt, keys, values, is_causal=True, scale=scale)
        else:
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = _window_mask(key_pos, query_pos, sliding_window)
            out = F.scaled_dot_product_attention(qt, keys, values, attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1)
