"""Attention over the paged KV cache with Triton kernels (CUDA; CPU only under the
interpreter, for tests). Same contract and metadata as the torch backend.

Per step (computed once, shared by every layer): requests with one query go to the split-KV
decode kernel, the others (prefill chunks, with or without a cached prefix) to the prefill
kernel. A step of decodes only reads no host-side lengths, so it can be captured in a CUDA
graph and replayed for other lengths (see ``heron.worker.cuda_graphs``).

Tree requests (``md.tree_masks``, more than one query) go to the prefill kernel with their
masks packed into one flat int8 tensor plus per-request offsets, built with the plan; a tree
request with one query is an ordinary decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.attention.metadata import AttentionMetadata
from heron.kernels.attention_decode import choose_num_splits, paged_decode_attention
from heron.kernels.attention_prefill import paged_prefill_attention
from heron.kernels.kv_store import store_kv
from heron.kernels.runtime import num_sms, require_triton


@dataclass
class _Plan:
    """How one step's requests split between the two kernels."""

    all_decode: bool
    decode_tokens: torch.Tensor | None  # (num_decodes,) flat token index; None if all_decode
    decode_seq_lens: torch.Tensor | None  # (num_decodes,)
    decode_tables: torch.Tensor | None  # (num_decodes, max_blocks)
    num_decodes: int
    prefill_rows: torch.Tensor | None  # (num_prefills,) request index, None if none
    max_prefill_q_len: int
    tree_mask: torch.Tensor | None = None  # (sum of Q_i^2 over tree requests,) int8
    tree_offsets: torch.Tensor | None = None  # (num_reqs,) int64 start in tree_mask, -1: causal


def _pack_tree_masks(md: AttentionMetadata, trees: list[int], device):
    """Request i's (Q_i, Q_i) mask row-major at tree_offsets[i] of one flat int8 tensor."""
    offsets, parts, used = [-1] * md.num_reqs, [], 0
    for i in trees:
        offsets[i] = used
        parts.append(md.tree_masks[i].reshape(-1).to(torch.int8))
        used += parts[-1].numel()
    return (torch.cat(parts).to(device),
            torch.tensor(offsets, dtype=torch.long).to(device))


def _plan(md: AttentionMetadata) -> _Plan:
    """Built once per step; a decode-only step needs no device tensors (graph capture)."""
    lens = md.query_lens_cpu
    if all(n == 1 for n in lens):
        return _Plan(True, None, None, None, len(lens), None, 0)
    trees = md.tree_rows()  # [] without tree masks
    dev = md.seq_lens.device
    decodes = [i for i, n in enumerate(lens) if n == 1]
    prefills = [i for i, n in enumerate(lens) if n > 1]
    tokens = seq_lens = tables = None
    if decodes:
        idx = torch.tensor(decodes, dtype=torch.long, device=dev)
        tokens, seq_lens, tables = md.query_start_loc[idx], md.seq_lens[idx], md.block_tables[idx]
    tree_mask, tree_offsets = _pack_tree_masks(md, trees, dev) if trees else (None, None)
    return _Plan(False, tokens, seq_lens, tables, len(decodes),
                 torch.tensor(prefills, dtype=torch.long, device=dev),
                 max(lens[i] for i in prefills), tree_mask, tree_offsets)


class TritonAttentionBackend:
    """Paged attention with Triton kernels; constructed only where they can run (CUDA, or
    CPU under the interpreter)."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        require_triton(device)
        self.num_sms = num_sms(device)

    def forward(self, q, k, v, kv_cache, md: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D); kv_cache: (2, num_blocks, block_size, KVH, D).

        Writes k, v into their slots (negative slots are skipped), then returns the attention
        output (T, H, D).
        """
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        store_kv(k, v, key_cache, value_cache, md.slot_mapping)
        if md.tree_masks:
            md.tree_rows(sliding_window)  # checks the masks; refuses a windowed layer
        if "triton" not in md.backend_cache:
            md.backend_cache["triton"] = _plan(md)
        plan = md.backend_cache["triton"]
        out = torch.empty_like(q)
        splits = choose_num_splits(plan.num_decodes, k.shape[1], self.num_sms)
        if plan.all_decode:
            paged_decode_attention(q, key_cache, value_cache, out, md.seq_lens, md.block_tables,
                                   scale, splits, sliding_window)
            return out
        if plan.num_decodes:
            q_decode = q[plan.decode_tokens]  # (num_decodes, H, D)
            decode_out = torch.empty_like(q_decode)
            paged_decode_attention(q_decode, key_cache, value_cache, decode_out,
                                   plan.decode_seq_lens, plan.decode_tables, scale, splits,
                                   sliding_window)
            out[plan.decode_tokens] = decode_out
        paged_prefill_attention(q, key_cache, value_cache, out, plan.prefill_rows,
                                md.query_start_loc, md.seq_lens, md.block_tables,
                                plan.max_prefill_q_len, scale, sliding_window, plan.tree_mask,
                                plan.tree_offsets)
        return out
