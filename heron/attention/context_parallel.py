"""Context parallelism's attention: each rank of the CP group holds every ``N``-th KV block of
the pool and attends over those only; the partial outputs merge exactly.

Sharding. The engine core's pool has ``N x L`` block ids; CP rank ``r`` (of ``N``) stores the
blocks whose id ``b % N == r``, at local index ``b // N`` of its own ``L``-block pool. Block
tables and slot mappings stay the core's (global ids): each rank translates them once per
step and KV cache group (``local_plan``, cached in ``md.backend_cache``). A token whose block is
not local is not written here (its K/V are written by the rank that owns the block); a block
of a table that is not local is not read here.

Attention, in steps whose rows are not split (decode steps, short prefills): every rank
runs every query of the step (the rest of the model is replicated). Over its local keys a
rank computes, per query and head, the softmax-normalised output
``o_r`` and the log-sum-exp ``lse_r`` of its scaled scores (``-inf``, ``o_r = 0`` when none of
its keys is visible to the query). The ranks all-gather ``(o_r, lse_r)`` over the CP group
(one collective per layer) and every rank merges them in rank order, so all ranks hold the
same bits: ``lse = logsumexp_r lse_r``, ``o = sum_r exp(lse_r - lse) o_r``. That is the whole
softmax over the union of the keys, i.e. one rank's result up to float rounding.

Steps with a long enough prefill split its rows over the ranks (``md.cp_split``): each
rank runs the model on its stripes of the prefill rows and every decode row, attends the
decodes as above and its prefill queries by the ring pass of ``context_parallel_ring``.

Masks are by key position: a key at table column ``j``, offset ``o`` sits at position
``j * block_size + o``; query ``q`` of a request sees keys at positions ``<= q`` (and
``> q - window`` for a sliding-window layer). GQA, any mix of prefill chunks and decodes.
Tree attention masks and StreamingLLM are refused (the engine refuses them earlier).
The partials are computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.attention.context_parallel_ring import RingAttention, ring_plan
from heron.attention.metadata import AttentionMetadata
from heron.attention.partial_attention import attend_partial, merge_partials

_FAR = 1 << 62  # key position of padding and non-local keys: after every query (masked)


@dataclass
class ContextParallelStats:
    """This process's KV tokens written into its share of the pool (counted once per step
    and KV cache group), and the prefill tokens it computed in steps whose prefill rows were
    split over the CP ranks (``context_parallel_ring``)."""

    kv_tokens_stored: int = 0
    split_prefill_tokens: int = 0


CP_STATS = ContextParallelStats()


@dataclass
class LocalKeys:
    """The local keys some queries attend over: ``blocks`` (B, M) local block indices
    (padding: 0), ``key_pos`` (B, M * block_size) their positions (``_FAR``: not a key),
    ``query_pos`` (B, Q) the queries' positions."""

    blocks: torch.Tensor
    key_pos: torch.Tensor
    query_pos: torch.Tensor


@dataclass
class LocalPlan:
    """One step of one KV cache group as CP rank ``rank`` sees it."""

    write_rows: torch.Tensor  # (W,) flat token indices whose slot is in a local block
    write_slots: torch.Tensor  # (W,) their slots in the local pool
    decode_rows: torch.Tensor | None  # (B,) flat token index of each decode query
    decode: LocalKeys | None  # the decodes, batched
    prefills: list[tuple[int, int, LocalKeys]]  # (first token, query count, keys) per chunk


def local_plan(md: AttentionMetadata, rank: int, size: int,
               decodes_only: bool = False) -> LocalPlan:
    """Translate the step's global slots and block tables for CP rank ``rank`` of ``size``
    (``decodes_only``: the decode queries alone, and only their tokens written: a step whose
    prefill rows are split, ``context_parallel_ring``)."""
    bs = md.block_size
    slots = md.slot_mapping
    local = (slots // bs) % size == rank
    if decodes_only:
        is_decode = torch.zeros_like(local)
        one_query = torch.tensor(md.query_lens_cpu, device=slots.device) == 1
        is_decode[md.query_start_loc[:-1][one_query]] = True
        local &= is_decode
    rows = local.nonzero().squeeze(1)
    kept = slots[rows]
    write_slots = (kept // bs) // size * bs + kept % bs
    CP_STATS.kv_tokens_stored += int(rows.numel())
    device = slots.device
    tables = md.block_tables
    cols = torch.arange(tables.shape[1], device=device)
    used = cols < torch.tensor([-(-n // bs) for n in md.seq_lens_cpu], device=device)[:, None]
    mine = used & (tables % size == rank)  # (R, max_blocks)
    offsets = torch.arange(bs, device=device)
    decodes = [i for i, q in enumerate(md.query_lens_cpu) if q == 1]
    decode_rows = decode = None
    if decodes:
        idx = torch.tensor(decodes, device=device)
        decode_rows = md.query_start_loc[idx]
        decode = _batched_keys(tables[idx], mine[idx], md.seq_lens[idx] - 1, bs, size,
                               offsets)
    prefills = []
    for i, q_len in enumerate(md.query_lens_cpu):
        if q_len > 1 and not decodes_only:
            col = mine[i].nonzero().squeeze(1)
            key_pos = (col[:, None] * bs + offsets).reshape(1, -1)
            seq_len = md.seq_lens_cpu[i]
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[None]
            keys = LocalKeys((tables[i, col] // size)[None], key_pos, query_pos)
            prefills.append((md.query_start_loc_cpu[i], q_len, keys))
    return LocalPlan(rows, write_slots, decode_rows, decode, prefills)


def _batched_keys(tables, mine, query_pos, bs: int, size: int, offsets) -> LocalKeys:
    """Each row's local blocks moved to the front (stable), padded to the longest row."""
    order = torch.sort((~mine).to(torch.int8), dim=1, stable=True).indices
    width = max(int(mine.sum(1).max()), 1)
    order = order[:, :width]
    valid = mine.gather(1, order)
    blocks = torch.where(valid, tables.gather(1, order) // size, 0)
    key_pos = order[:, :, None] * bs + offsets  # (B, M, bs)
    key_pos = torch.where(valid[:, :, None], key_pos, _FAR).flatten(1)
    return LocalKeys(blocks, key_pos, query_pos[:, None])


class ContextParallelAttention:
    """The attention backend of a CP rank (any device; plain torch): writes the step's K/V
    that fall in its blocks, attends over its blocks, merges with the group's partials.
    ``group``: the CP group (``heron.distributed.get_cp_group()``)."""

    name = "torch-cp"

    def __init__(self, group) -> None:
        self.group = group

    def forward(self, q, k, v, kv_cache, md: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D); kv_cache: (2, local_blocks, block_size, KVH, D)
        -> (T, H, D), the same on every rank of the group."""
        if md.tree_masks or md.streaming is not None:
            raise NotImplementedError("context parallelism supports neither tree attention "
                                      "nor StreamingLLM")
        if md.cp_split is not None:
            return self._split_forward(q, k, v, kv_cache, md, scale, sliding_window)
        plan = md.backend_cache.get("cp")
        if plan is None:
            plan = md.backend_cache["cp"] = local_plan(md, self.group.rank_in_group,
                                                       self.group.world_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        _write(key_cache, value_cache, plan.write_slots, k[plan.write_rows], v[plan.write_rows])
        part = self._partial(q, key_cache, value_cache, plan, scale, sliding_window)
        return self._merged(part, q.dtype)

    def _merged(self, part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(T, H, D + 1) this rank's partials -> (T, H, D) merged over the group."""
        d = part.shape[-1] - 1
        gathered = self.group.all_gather(part)  # (N, T, H, D + 1)
        out, _ = merge_partials(gathered[..., :d], gathered[..., d])
        return out.to(dtype)

    def _split_forward(self, q, k, v, kv_cache, md: AttentionMetadata, scale, sliding_window):
        """A step whose prefill rows are split over the group (``md.cp_split``): q, k, v hold
        this rank's rows only. Decodes as above; prefill queries by the ring pass."""
        split = md.cp_split
        rank, size = self.group.rank_in_group, self.group.world_size
        key = ("ring", sliding_window)
        if key not in md.backend_cache:
            ring = ring_plan(md, split, sliding_window)
            decodes = local_plan(md, rank, size, decodes_only=True) \
                if split.decode_rows.numel() else None
            if "cp-stored" not in md.backend_cache:  # once per step and KV cache group
                md.backend_cache["cp-stored"] = True
                # (local_plan counted the decodes' tokens)
                CP_STATS.kv_tokens_stored += sum(s.writes[0].numel() for s in ring.shards)
            md.backend_cache[key] = (ring, decodes)
        ring, decodes = md.backend_cache[key]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        out = torch.empty_like(q)
        if decodes is not None:
            local = torch.searchsorted(split.local_rows.to(q.device), decodes.write_rows)
            _write(key_cache, value_cache, decodes.write_slots, k[local], v[local])
            rows = split.decode_local.to(q.device)
            part = self._partial(q[rows], key_cache, value_cache, _rebased(decodes, rows.numel()),
                                 scale, sliding_window)
            out[rows] = self._merged(part, q.dtype)
        if split.prefill_local.numel():
            rows = split.prefill_local.to(q.device)
            out[rows] = RingAttention(self.group).forward(
                q[rows], k[rows], v[rows], key_cache, value_cache, ring, scale,
                sliding_window).to(q.dtype)
        return out

    @staticmethod
    def _partial(q, key_cache, value_cache, plan: LocalPlan, scale, sliding_window):
        """(T, H, D + 1) float32: this rank's partial output, its lse in the last column."""
        t, h, d = q.shape
        part = torch.empty(t, h, d + 1, dtype=torch.float32, device=q.device)
        if plan.decode is not None:
            rows, keys = plan.decode_rows, plan.decode
            out, lse = attend_partial(q[rows][:, None], *_gather(key_cache, value_cache, keys),
                                      keys.key_pos, keys.query_pos, scale, sliding_window)
            part[rows, :, :d] = out[:, 0]
            part[rows, :, d] = lse[:, 0]
        for start, n, keys in plan.prefills:
            out, lse = attend_partial(q[None, start:start + n],
                                      *_gather(key_cache, value_cache, keys), keys.key_pos,
                                      keys.query_pos, scale, sliding_window)
            part[start:start + n, :, :d] = out[0]
            part[start:start + n, :, d] = lse[0]
        return part


def _write(key_cache, value_cache, slots, k, v) -> None:
    """Store k, v (W, KVH, D) at ``slots`` (W,) of this rank's pool."""
    kvh, d = k.shape[1], k.shape[2]
    key_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    value_cache.view(-1, kvh, d).index_copy_(0, slots, v)


def _rebased(plan: LocalPlan, num_decodes: int) -> LocalPlan:
    """``plan``'s decodes as rows 0 .. num_decodes - 1 of a tensor of the decodes alone."""
    rows = torch.arange(num_decodes, device=plan.decode_rows.device)
    return LocalPlan(plan.write_rows, plan.write_slots, rows, plan.decode, [])


def _gather(key_cache, value_cache, keys: LocalKeys):
    """(B, M * block_size, KVH, D) keys and values of ``keys.blocks``."""
    return (key_cache[keys.blocks].flatten(1, 2), value_cache[keys.blocks].flatten(1, 2))
