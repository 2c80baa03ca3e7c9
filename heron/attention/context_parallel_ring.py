"""Context parallelism for long prefills: the step's prefill tokens are split across the CP
ranks, and each rank attends its query slice over K/V passed round the ring.

Token split (``split_tokens``). Of a step's flat tokens, the *prefill rows* (those of
requests with more than one query) are dealt to the ``N`` ranks in stripes of ``stripe``
rows, round robin (a striped split keeps causal attention's work even across ranks); decode
rows (one query per request) stay on every rank; stripes count on from the position
of the step's first prefill row. Rank ``r`` runs the whole model on its
``local_rows`` only: decodes, then its stripes, in the step's order. Steps with fewer than
``N x stripe`` prefill rows are not split (every rank runs every token, as for decodes).

Ring attention (``RingAttention``), per layer. A request's keys are of two kinds: *old*
keys (positions before this step's chunk), stored in the pool blocks of whichever rank owns
the block (block id % N), and *new* keys (this chunk), which only the rank that computed
their rows holds. Rank ``s``'s *shard* is the K/V of the old keys in its blocks for the step's
prefill requests, then the new keys of its stripes: every key of the step's prefill requests
is in exactly one shard. In ``N`` rounds every shard visits every rank: a rank attends its
queries over the shard it holds while it sends that shard on to the next rank and receives
the previous rank's (transfer overlapped with compute), and merges the partial outputs by
log-sum-exp. On the way a rank also stores the new keys whose slots are in its blocks, so
the pool ends as if it had written them itself. Each rank can lay out every shard from the
step's metadata (tables and lengths are the core's, shared), so only K/V travel.

Decodes keep the sharded-KV path of ``context_parallel``: every rank attends each decode
query over its own blocks and the partials are all-gathered and merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.attention.metadata import AttentionMetadata
from heron.attention.partial_attention import attend_partial


@dataclass
class TokenSplit:
    """Which of a step's ``T`` flat token rows each of the ``size`` CP ranks computes."""

    rank: int
    size: int
    local_rows: torch.Tensor  # (T_r,) the rows this rank computes, ascending
    decode_rows: torch.Tensor  # (D,) rows of one-query requests: every rank computes them
    decode_local: torch.Tensor  # (D,) their indices in local_rows
    prefill_rows: list[torch.Tensor]  # per rank s: (P_s,) the prefill rows s computes
    prefill_local: torch.Tensor  # (P_rank,) this rank's prefill rows' indices in local_rows
    prefill_reqs: list[int]  # the requests with prefill rows, ascending


def split_tokens(query_lens: list[int], query_starts: list[int], seq_lens: list[int],
                 rank: int, size: int, stripe: int) -> TokenSplit | None:
    """The striped split of a step's prefill rows (module docstring); None when the step has
    fewer than ``size * stripe`` of them (every rank then computes every row). The stripes
    count from the position of the step's first prefill row, so the chunks of one long
    prompt deal their stripes on where the last chunk stopped."""
    prefill_reqs = [i for i, n in enumerate(query_lens) if n > 1]
    prefill = [row for i in prefill_reqs for row in range(query_starts[i],
                                                          query_starts[i] + query_lens[i])]
    if size < 2 or len(prefill) < size * stripe:
        return None
    first = prefill_reqs[0]
    offset = seq_lens[first] - query_lens[first]
    decode = [query_starts[i] for i, n in enumerate(query_lens) if n == 1]
    owned: list[list[int]] = [[] for _ in range(size)]
    for k, row in enumerate(prefill):
        owned[((k + offset) // stripe) % size].append(row)
    local = sorted(decode + owned[rank])
    index = {row: i for i, row in enumerate(local)}
    return TokenSplit(rank, size, torch.tensor(local), torch.tensor(decode, dtype=torch.long),
                      torch.tensor([index[r] for r in decode], dtype=torch.long),
                      [torch.tensor(rows, dtype=torch.long) for rows in owned],
                      torch.tensor([index[r] for r in owned[rank]], dtype=torch.long),
                      prefill_reqs)


@dataclass
class ShardLayout:
    """Rank ``s``'s shard for one KV cache group (and window): the K/V of ``old_blocks`` (B,)
    (its local block indices: ``num_old = B * block_size`` rows), then its ``num_new`` new
    keys. ``keys[i]`` = (shard rows, positions) of request ``i``'s keys in it, positions
    ascending; ``writes`` = (new-key indices, slots in *this* rank's pool) of the new keys
    this rank stores."""

    old_blocks: torch.Tensor
    num_old: int
    num_new: int
    keys: dict[int, tuple[torch.Tensor, torch.Tensor]]
    writes: tuple[torch.Tensor, torch.Tensor]

    @property
    def length(self) -> int:
        return self.num_old + self.num_new


def shard_layout(md: AttentionMetadata, split: TokenSplit, shard_rank: int,
                 window: int | None, tables: torch.Tensor) -> ShardLayout:
    """Lay out ``shard_rank``'s shard as every rank sees it (module docstring); ``tables``:
    the step's block tables on the host. Old keys a sliding ``window`` hides from the whole
    chunk are left out."""
    bs, size = md.block_size, split.size
    new_rows = split.prefill_rows[shard_rank]
    new_pos = md_positions(md, new_rows)
    req_of_new = torch.bucketize(new_rows, torch.tensor(md.query_start_loc_cpu[1:]),
                                 right=True)
    offsets = torch.arange(bs)
    blocks, old = [], []
    for i in split.prefill_reqs:
        start = md.seq_lens_cpu[i] - md.query_lens_cpu[i]  # the chunk's first position
        lowest = 0 if window is None else max(0, start - window + 1)
        cols = torch.arange(lowest // bs, -(-start // bs))
        cols = cols[tables[i, cols] % size == shard_rank]
        pos = (cols[:, None] * bs + offsets).flatten()  # (len(cols) * bs,)
        rows = sum(len(b) for b in blocks) * bs + torch.arange(pos.numel())
        seen = (pos >= lowest) & (pos < start)
        old.append((i, rows[seen], pos[seen]))
        blocks.append(tables[i, cols] // size)
    old_blocks = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.long)
    num_old = old_blocks.numel() * bs
    keys = {}
    for i, rows, pos in old:
        mine = (req_of_new == i).nonzero().squeeze(1)
        idx = torch.cat([rows, num_old + mine])
        if idx.numel():
            keys[i] = (idx, torch.cat([pos, new_pos[mine]]))
    slots = md.slot_mapping.cpu()[new_rows]
    local = ((slots // bs) % size == split.rank).nonzero().squeeze(1)
    kept = slots[local]
    writes = (local, (kept // bs) // size * bs + kept % bs)
    return ShardLayout(old_blocks, num_old, len(new_rows), keys, writes)


def md_positions(md: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
    """(len(rows),) the sequence positions of flat rows ``rows`` (from the step's layout)."""
    starts = torch.tensor(md.query_start_loc_cpu[:-1])
    req = torch.bucketize(rows, torch.tensor(md.query_start_loc_cpu[1:]), right=True)
    first = torch.tensor(md.seq_lens_cpu) - torch.tensor(md.query_lens_cpu)
    return first[req] + rows - starts[req]


@dataclass
class RingPlan:
    """One step of one KV cache group (and window) on this rank: every rank's shard layout,
    and this rank's prefill queries per request: (indices into its prefill queries,
    positions)."""

    shards: list[ShardLayout]
    queries: dict[int, tuple[torch.Tensor, torch.Tensor]]


def ring_plan(md: AttentionMetadata, split: TokenSplit, window: int | None) -> RingPlan:
    rows = split.prefill_rows[split.rank]
    req = torch.bucketize(rows, torch.tensor(md.query_start_loc_cpu[1:]), right=True)
    positions = md_positions(md, rows)
    queries = {}
    for i in split.prefill_reqs:
        mine = (req == i).nonzero().squeeze(1)
        if mine.numel():
            queries[i] = (mine, positions[mine])
    tables = md.block_tables.cpu()
    shards = [shard_layout(md, split, s, window, tables) for s in range(split.size)]
    return RingPlan(shards, queries)


class RingAttention:
    """Attention of this rank's prefill queries over every shard, passed round the CP
    ``group`` (``heron.distributed.GroupCoordinator``)."""

    def __init__(self, group) -> None:
        self.group = group

    def forward(self, q, k, v, key_cache, value_cache, plan: RingPlan, scale: float,
                window: int | None) -> torch.Tensor:
        """q: (P, H, D), k, v: (P, KVH, D): this rank's prefill rows; key_cache, value_cache:
        (local_blocks, block_size, KVH, D) -> (P, H, D) float32 attention output. Stores the
        new keys that belong to this rank's blocks on the way."""
        size, rank = self.group.world_size, self.group.rank_in_group
        mine = plan.shards[rank]
        shard = torch.cat([torch.stack([key_cache[mine.old_blocks].flatten(0, 1),
                                        value_cache[mine.old_blocks].flatten(0, 1)]),
                           torch.stack([k, v]).to(key_cache.dtype)], dim=1)  # (2, L, KVH, D)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(size):
            owner = (rank - step) % size
            pending = None
            if step < size - 1:
                incoming = plan.shards[(owner - 1) % size]
                buffer = shard.new_empty((2, incoming.length) + tuple(shard.shape[2:]))
                pending = self.group.ring_exchange(shard, buffer)
            layout = plan.shards[owner]
            self._store(shard, layout, key_cache, value_cache)
            self._attend(q, shard, layout, plan, scale, window, out, lse)
            if pending is not None:
                pending()
                shard = buffer
        return out

    @staticmethod
    def _store(shard, layout: ShardLayout, key_cache, value_cache) -> None:
        """Write the shard's new keys whose slots are in this rank's blocks."""
        index, slots = layout.writes
        if index.numel():
            rows = shard[:, layout.num_old + index.to(shard.device)]  # (2, W, KVH, D)
            slots = slots.to(shard.device)
            kvh, d = shard.shape[2], shard.shape[3]
            key_cache.view(-1, kvh, d).index_copy_(0, slots, rows[0])
            value_cache.view(-1, kvh, d).index_copy_(0, slots, rows[1])

    @staticmethod
    def _attend(q, shard, layout: ShardLayout, plan: RingPlan, scale, window, out, lse):
        """Merge each request's attention over the shard's keys into (out, lse)."""
        for i, (rows, q_pos) in plan.queries.items():
            if i not in layout.keys:
                continue
            idx, k_pos = layout.keys[i]
            device = shard.device
            rows, idx = rows.to(device), idx.to(device)
            part_out, part_lse = attend_partial(
                q[rows][None], shard[0, idx][None], shard[1, idx][None],
                k_pos.to(device)[None], q_pos.to(device)[None], scale, window)
            merge_into(out, lse, rows, part_out[0], part_lse[0])


def merge_into(out, lse, rows, part_out, part_lse) -> None:
    """out[rows], lse[rows] := the log-sum-exp merge of (out, lse)[rows] and a partial over
    disjoint keys. out: (P, H, D), lse: (P, H) float32; -inf marks 'no key yet'."""
    old_lse = lse[rows]
    new_lse = torch.logaddexp(old_lse, part_lse)
    safe = torch.where(torch.isfinite(new_lse), new_lse, 0.0)
    keep = torch.exp(old_lse - safe)[..., None]  # 0 where old_lse is -inf
    take = torch.exp(part_lse - safe)[..., None]
    out[rows] = keep * out[rows] + take * part_out
    lse[rows] = new_lse
