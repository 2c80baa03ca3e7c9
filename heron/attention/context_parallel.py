"""Context parallelism's attention: each rank of the CP group holds every ``N``-th KV block of
the pool and attends over those only; the partial outputs merge exactly.

Sharding. The engine core's pool has ``N x L`` block ids; CP rank ``r`` (of ``N``) stores the
blocks whose id ``b % N == r``, at local index ``b // N`` of its own ``L``-block pool. Block
tables and slot mappings stay the core's (global ids): each rank translates them once per
step and KV cache group (``local_plan``, cached in ``md.backend_cache``). A token whose block is
not local is not written here (its K/V are written by the rank that owns the block); a block
of a table that is not local is not read here.

Attention. Every rank runs every query of the step (the rest of the model is replicated).
Over its local keys a rank computes, per query and head, the softmax-normalised output
``o_r`` and the log-sum-exp ``lse_r`` of its scaled scores (``-inf``, ``o_r = 0`` when none of
its keys is visible to the query). The ranks all-gather ``(o_r, lse_r)`` over the CP group
(one collective per layer) and every rank merges them in rank order, so all ranks hold the
same bits: ``lse = logsumexp_r lse_r``, ``o = sum_r exp(lse_r - lse) o_r``. That is the whole
softmax over the union of the keys, i.e. one rank's result up to float rounding.

Masks are by key position: a key at table column ``j``, offset ``o`` sits at position
``j * block_size + o``; query ``q`` of a request sees keys at positions ``<= q`` (and
``> q - window`` for a sliding-window layer). GQA, any mix of prefill chunks and decodes.
Tree attention masks and StreamingLLM are refused (the engine refuses them earlier).
The partials are computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.attention.metadata import AttentionMetadata

_FAR = 1 << 62  # key position of padding and non-local keys: after every query (masked)
_MAX_SCORES = 1 << 24  # score elements per query chunk (64 MiB of float32)
_CHUNK_ROWS = 256  # prefill queries per chunk: causal chunks skip the keys after them


@dataclass
class ContextParallelStats:
    """This process's KV tokens written into its share of the pool (counted once per step
    and KV cache group)."""

    kv_tokens_stored: int = 0


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


def local_plan(md: AttentionMetadata, rank: int, size: int) -> LocalPlan:
    """Translate the step's global slots and block tables for CP rank ``rank`` of ``size``."""
    bs = md.block_size
    slots = md.slot_mapping
    local = (slots // bs) % size == rank
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
        if q_len > 1:
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


def attend_partial(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   key_pos: torch.Tensor, query_pos: torch.Tensor, scale: float,
                   sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (B, Q, H, D); keys, values: (B, L, KVH, D); key_pos: (B, L), ascending along L;
    query_pos: (B, Q), ascending along Q -> (out (B, Q, H, D), lse (B, Q, H)), both float32:
    softmax attention over the keys each query sees (causal by position, within
    ``sliding_window``), and the log-sum-exp of those scaled scores; a query that sees none
    gets out 0, lse -inf. Queries go in chunks; with B = 1 each chunk reads only the keys
    some of its queries see, and masks only where some query does not see them all."""
    b, nq, h, d = q.shape
    out = torch.zeros(b, nq, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, nq, h), float("-inf"), dtype=torch.float32, device=q.device)
    if keys.shape[1] == 0:  # no local key at all
        return out, lse
    k_t = keys.float().permute(0, 2, 3, 1)  # (B, KVH, D, L)
    v_t = values.float().transpose(1, 2)  # (B, KVH, L, D)
    rows = max(1, min(_CHUNK_ROWS, _MAX_SCORES // (h * keys.shape[1] * b)))
    for start in range(0, nq, rows):
        stop = min(start + rows, nq)
        lo, hi = _key_range(key_pos, query_pos[:, start:stop], sliding_window)
        if hi > lo:
            o, m = _attend_chunk(q[:, start:stop], k_t[..., lo:hi], v_t[:, :, lo:hi],
                                 key_pos[:, lo:hi], query_pos[:, start:stop], scale,
                                 sliding_window)
            out[:, start:stop] = o
            lse[:, start:stop] = m
    return out, lse


def _key_range(key_pos, query_pos, sliding_window) -> tuple[int, int]:
    """The slice of keys some query of the chunk may see (every key for a batch, B > 1)."""
    if key_pos.shape[0] > 1:
        return 0, key_pos.shape[1]
    kp = key_pos[0]
    hi = int(torch.searchsorted(kp, query_pos[0, -1], right=True))
    lo = 0
    if sliding_window is not None:
        lo = int(torch.searchsorted(kp, query_pos[0, 0] - sliding_window, right=True))
    return lo, hi


def _attend_chunk(q, k_t, v_t, key_pos, query_pos, scale, sliding_window):
    """One query chunk: q (B, n, H, D), k_t (B, KVH, D, L), v_t (B, KVH, L, D) ->
    (out (B, n, H, D), lse (B, n, H))."""
    b, n, h, d = q.shape
    kvh = k_t.shape[1]
    g = h // kvh
    qg = (q.float() * scale).view(b, n, kvh, g, d).permute(0, 2, 3, 1, 4)
    scores = (qg.reshape(b, kvh, g * n, d) @ k_t).view(b, kvh, g, n, -1)  # (B, KVH, G, n, L)
    first_q, last_k = query_pos[:, :1], key_pos[:, -1:]
    partial = bool((last_k > first_q).any())  # some query does not see the last key
    if sliding_window is not None:
        partial |= bool((key_pos[:, :1] <= query_pos[:, -1:] - sliding_window).any())
    if partial:
        seen = key_pos[:, None, :] <= query_pos[:, :, None]  # (B, n, L)
        if sliding_window is not None:
            seen &= key_pos[:, None, :] > query_pos[:, :, None] - sliding_window
        scores.masked_fill_(~seen[:, None, None], float("-inf"))
    peak = scores.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    p = scores.sub_(peak).exp_()
    total = p.sum(-1, keepdim=True)  # (B, KVH, G, n, 1)
    out = (p.view(b, kvh, g * n, -1) @ v_t).view(b, kvh, g, n, d)
    out.div_(total.clamp_min(torch.finfo(torch.float32).tiny))
    lse = (peak + torch.log(total)).squeeze(-1)  # -inf where total is 0
    return out.permute(0, 3, 1, 2, 4).reshape(b, n, h, d), lse.permute(0, 3, 1, 2).reshape(b, n, h)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs: (N, T, H, D), lses: (N, T, H): N partial attentions over disjoint key sets ->
    (out (T, H, D), lse (T, H)) of attention over their union. Summed in order 0..N-1."""
    lse = torch.logsumexp(lses, 0)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    weights = torch.exp(lses - safe)  # (N, T, H); 0 for a part with lse -inf
    out = weights[0, ..., None] * outs[0]
    for r in range(1, outs.shape[0]):
        out = out + weights[r, ..., None] * outs[r]
    return out, lse


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
        plan = md.backend_cache.get("cp")
        if plan is None:
            plan = md.backend_cache["cp"] = local_plan(md, self.group.rank_in_group,
                                                       self.group.world_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        kvh, d = k.shape[1], k.shape[2]
        key_cache.view(-1, kvh, d).index_copy_(0, plan.write_slots, k[plan.write_rows])
        value_cache.view(-1, kvh, d).index_copy_(0, plan.write_slots, v[plan.write_rows])
        part = self._partial(q, key_cache, value_cache, plan, scale, sliding_window)
        gathered = self.group.all_gather(part)  # (N, T, H, D + 1)
        out, _ = merge_partials(gathered[..., :d], gathered[..., d])
        return out.to(q.dtype)

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


def _gather(key_cache, value_cache, keys: LocalKeys):
    """(B, M * block_size, KVH, D) keys and values of ``keys.blocks``."""
    return (key_cache[keys.blocks].flatten(1, 2), value_cache[keys.blocks].flatten(1, 2))
