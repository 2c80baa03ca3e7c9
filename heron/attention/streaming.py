"""StreamingLLM attention over the paged KV cache (Xiao et al., "Efficient Streaming Language
Models with Attention Sinks", 2023).

A StreamingLLM request (``SamplingParams.streaming_kv = (S, W)``) keeps the first S tokens
(the attention sinks) and the last W in its cache; the KV manager releases the blocks in
between as generation runs. The paper places the cached tokens at consecutive positions *in
the cache*: a query past ``S + W`` sits at ``S + W - 1``, sink ``i`` at ``i``. heron stores keys
rotated at their true positions, as always, and gets the paper's scores without rotating a
key again, because a RoPE score depends only on the distance between query and key:

- a window key at ``j`` (true distance ``p - j``, in-cache distance the same) is scored with
  the usual q, rotated at ``p``;
- sink ``i`` (in-cache distance ``S + W - 1 - i``) is scored with ``q_sink``, the same query
  rotated at ``S + W - 1``: ``<R(S+W-1) q, R(i) k> = <R(S+W-1-i) q, k>``.

Until ``p >= S + W`` nothing has been evicted and every key is scored with q. Layers with a
sliding window of their own keep it (StreamingLLM applies to full-attention layers).

A step's requests split three ways, once per step (``_StreamingPlan``, shared by every layer):
requests that do not stream go through the backend as a sub-batch; the decodes of streaming
requests (one query each, any number) are one batched call; their prefill chunks go one by
one through ``sink_window_attention`` (a chunk's queries see different windows). The batched
decode is heron's C++ kernel (``torch.ops.heron_cpu.streaming_decode_attention``, one online
softmax over each request's sink keys, then its window keys, read from their pages) under the
cpu backend, and elsewhere (torch, triton) a padded gather of every request's sink and window
keys with one masked softmax (``_decode_gathered``). Neither reads a released position.
``benchmarks/streaming_decode.py`` times a decode step against full KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.attention.metadata import AttentionMetadata


def streaming_forward(backend, q: torch.Tensor, q_sink: torch.Tensor | None, k: torch.Tensor,
                      v: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                      scale: float, sliding_window: int | None) -> torch.Tensor:
    """q, q_sink: (T, H, D); k, v: (T, KVH, D); kv_cache (2, num_blocks, block_size, KVH, D).
    Requests without StreamingLLM go through ``backend``; the others are computed here
    (their K/V written to their slots first). Returns (T, H, D)."""
    if sliding_window is not None:
        return backend.forward(q, k, v, kv_cache, md, scale, sliding_window)
    if q_sink is None:
        raise ValueError("this model's attention does not pass the sink queries StreamingLLM "
                         "needs (streaming_kv is supported by the Llama family and Gemma 3)")
    plan = md.backend_cache.get("streaming")
    if plan is None:
        plan = md.backend_cache["streaming"] = _StreamingPlan(md)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    decodes = plan.decodes
    if decodes is not None and decodes.tokens is None:  # the whole step: streaming decodes
        _write_kv(k, v, key_cache, value_cache, md.slot_mapping)
        return _decode(backend, q, q_sink, key_cache, value_cache, decodes, scale)
    out = torch.empty_like(q)
    if plan.plain is not None:
        idx = plan.plain_tokens
        out[idx] = backend.forward(q[idx], k[idx], v[idx], kv_cache, plan.plain, scale, None)
    idx = plan.streaming_tokens
    _write_kv(k[idx], v[idx], key_cache, value_cache, md.slot_mapping[idx])
    if decodes is not None:
        idx = decodes.tokens
        out[idx] = _decode(backend, q[idx], q_sink[idx], key_cache, value_cache, decodes, scale)
    for i in plan.chunk_rows:
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        sinks, window = md.streaming[i]
        out[start:end] = sink_window_attention(
            q[start:end], q_sink[start:end], key_cache, value_cache, md.block_tables[i],
            md.seq_lens_cpu[i], md.block_size, scale, sinks, window)
    return out


def _write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: (N, KVH, D) stored at ``slots`` (N,) of the caches (num_blocks, block_size, KVH, D)."""
    key_cache.flatten(0, 1).index_copy_(0, slots, k)
    value_cache.flatten(0, 1).index_copy_(0, slots, v)


@dataclass
class _Decodes:
    """The step's decodes of streaming requests, as one batch of B requests."""

    tokens: torch.Tensor | None  # (B,) their flat token indices; None: the whole step, in order
    block_tables: torch.Tensor  # (B, max_blocks)
    seq_lens: torch.Tensor  # (B,)
    sinks: torch.Tensor  # (B,) int64
    windows: torch.Tensor  # (B,) int64
    block_size: int
    gather: _Gather | None = None  # the padded gather's indices, built on first use


class _StreamingPlan:
    """The step split once (shared by every layer): requests that do not stream (``plain``, a
    metadata of their own for the backend, and their ``plain_tokens``), the decodes of
    streaming requests (``decodes``, or None) and their prefill chunks (``chunk_rows``)."""

    def __init__(self, md: AttentionMetadata) -> None:
        if md.tree_masks:
            raise ValueError("tree speculation does not combine with StreamingLLM requests")
        qsl = md.query_start_loc_cpu
        streaming_rows = [i for i, s in enumerate(md.streaming) if s is not None]
        plain_rows = [i for i, s in enumerate(md.streaming) if s is None]
        decode_rows = [i for i in streaming_rows if md.query_lens_cpu[i] == 1]
        self.chunk_rows = [i for i in streaming_rows if md.query_lens_cpu[i] > 1]
        device = md.slot_mapping.device
        self.streaming_tokens = _token_index(qsl, streaming_rows, device)
        self.plain_tokens = _token_index(qsl, plain_rows, device)
        self.plain = _subset(md, plain_rows, self.plain_tokens) if plain_rows else None
        self.decodes = _decodes(md, decode_rows) if decode_rows else None


def _token_index(qsl: list[int], rows: list[int], device) -> torch.Tensor:
    index = [t for i in rows for t in range(qsl[i], qsl[i + 1])]
    return torch.tensor(index, dtype=torch.long, device=device)


def _subset(md: AttentionMetadata, rows: list[int], tokens: torch.Tensor) -> AttentionMetadata:
    """``md`` restricted to requests ``rows`` (in order) and their ``tokens``."""
    query_lens = [md.query_lens_cpu[i] for i in rows]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    index = torch.tensor(rows, dtype=torch.long, device=md.seq_lens.device)
    return AttentionMetadata(
        slot_mapping=md.slot_mapping[tokens], block_tables=md.block_tables[index],
        seq_lens=md.seq_lens[index],
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=md.seq_lens.device),
        query_start_loc_cpu=starts, query_lens_cpu=query_lens,
        seq_lens_cpu=[md.seq_lens_cpu[i] for i in rows], block_size=md.block_size)


def _decodes(md: AttentionMetadata, rows: list[int]) -> _Decodes:
    """The decodes of requests ``rows`` (streaming, one query each), in order."""
    device = md.seq_lens.device
    tokens = [md.query_start_loc_cpu[i] for i in rows]
    whole = len(rows) == md.num_reqs and tokens == list(range(len(md.slot_mapping)))
    index = torch.tensor(rows, dtype=torch.long, device=device)

    def column(j: int) -> torch.Tensor:  # (B,)
        return torch.tensor([md.streaming[i][j] for i in rows], dtype=torch.long, device=device)

    return _Decodes(
        tokens=None if whole else torch.tensor(tokens, dtype=torch.long, device=device),
        block_tables=md.block_tables if whole else md.block_tables[index],
        seq_lens=md.seq_lens if whole else md.seq_lens[index], sinks=column(0),
        windows=column(1), block_size=md.block_size)


def _decode(backend, q: torch.Tensor, q_sink: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, d: _Decodes, scale: float) -> torch.Tensor:
    """One query per request of ``d``: q, q_sink (B, H, D) -> (B, H, D), through heron's C++
    kernel under the cpu backend, else through the padded gather."""
    if getattr(backend, "name", None) == "cpu" and q.device.type == "cpu" \
            and q.shape[-1] % 8 == 0:
        return torch.ops.heron_cpu.streaming_decode_attention(
            q, q_sink, key_cache, value_cache, d.block_tables, d.seq_lens, d.sinks, d.windows,
            scale)
    if d.gather is None:
        d.gather = _gather_indices(d)
    return _decode_gathered(q, q_sink, key_cache, value_cache, d.gather, scale)


@dataclass
class _Gather:
    """Where each decode's keys sit, padded to the most keys one reads (L): column c < S of an
    evicting request is sink c, scored with q_sink; the others are its window, or while
    nothing is evicted its whole context."""

    slots: torch.Tensor  # (B, L) flat cache slot of each column (the query's own where padding)
    valid: torch.Tensor  # (B, L) bool: the column holds a key of the request
    sink_cols: torch.Tensor  # (B, NS) bool: column scored with q_sink (NS: most sinks used)


def _gather_indices(d: _Decodes) -> _Gather:
    pos, sinks, windows = d.seq_lens - 1, d.sinks, d.windows  # (B,)
    evicting = pos >= sinks + windows  # (B,): the middle is released
    span = torch.minimum(d.seq_lens, sinks + windows)  # (B,) keys read
    cols = torch.arange(int(span.max()), device=pos.device)  # (L,)
    shift = torch.where(evicting, pos - (sinks + windows - 1), 0)  # (B,) window column c: c + shift
    key_pos = cols + shift[:, None] * (cols >= sinks[:, None])  # (B, L)
    valid = cols < span[:, None]  # (B, L)
    key_pos = torch.where(valid, key_pos, pos[:, None])  # padding: the query's own key
    blocks = d.block_tables.gather(1, key_pos // d.block_size)  # (B, L)
    used = sinks[evicting]
    num_sink_cols = int(used.max()) if used.numel() else 0
    sink_cols = evicting[:, None] & (cols[:num_sink_cols] < sinks[:, None])  # (B, NS)
    return _Gather(blocks * d.block_size + key_pos % d.block_size, valid, sink_cols)


def _decode_gathered(q: torch.Tensor, q_sink: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, g: _Gather, scale: float) -> torch.Tensor:
    """q, q_sink: (B, H, D); caches (num_blocks, block_size, KVH, D) -> (B, H, D): each
    request's keys gathered into (B, L, KVH, D), one masked softmax (float32) over them."""
    batch, heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    keys = key_cache.flatten(0, 1)[g.slots]  # (B, L, KVH, D)
    values = value_cache.flatten(0, 1)[g.slots]
    grouped = (batch, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("bkgd,blkd->bkgl", q.reshape(grouped), keys).float() * scale
    num_sink_cols = g.sink_cols.shape[1]  # scores: (B, KVH, G, L)
    if num_sink_cols:
        sink = torch.einsum("bkgd,blkd->bkgl", q_sink.reshape(grouped),
                            keys[:, :num_sink_cols]).float() * scale  # (B, KVH, G, NS)
        scores[..., :num_sink_cols] = torch.where(g.sink_cols[:, None, None, :], sink,
                                                  scores[..., :num_sink_cols])
    scores.masked_fill_(~g.valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(values.dtype)
    return torch.einsum("bkgl,blkd->bkgd", probs, values).reshape(batch, heads, dim)


def sink_window_attention(q: torch.Tensor, q_sink: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                          block_size: int, scale: float, sinks: int, window: int
                          ) -> torch.Tensor:
    """One request's last Q queries (positions ``seq_len - Q`` .. ``seq_len - 1``) over its
    StreamingLLM cache. q, q_sink: (Q, H, D); caches (num_blocks, block_size, KVH, D);
    block_table: (max_blocks,). Reads only the sink keys and the keys in some query's window
    (the released blocks between are never touched). Returns (Q, H, D)."""
    q_len, num_heads = q.shape[0], q.shape[1]
    device = q.device
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)  # (Q,)
    num_sinks = min(sinks, seq_len)
    # the window part starts where the first query's window does (never before the sinks)
    first = max(num_sinks, seq_len - q_len - window + 1)
    key_pos = torch.cat([torch.arange(num_sinks, device=device),
                         torch.arange(first, seq_len, device=device)])  # (L,)
    slots = block_table[key_pos // block_size] * block_size + key_pos % block_size
    group = num_heads // key_cache.shape[2]
    keys = key_cache.flatten(0, 1)[slots].repeat_interleave(group, 1)  # (L, H, D)
    values = value_cache.flatten(0, 1)[slots].repeat_interleave(group, 1)
    scores = torch.einsum("qhd,lhd->hql", q, keys) * scale  # (H, Q, L)
    evicting = query_pos >= sinks + window  # (Q,): its cache dropped the middle
    if num_sinks and bool(evicting.any()):
        sink_scores = torch.einsum("qhd,lhd->hql", q_sink, keys[:num_sinks]) * scale
        scores[:, :, :num_sinks] = torch.where(evicting.view(1, -1, 1), sink_scores,
                                               scores[:, :, :num_sinks])
    is_sink = key_pos < sinks
    visible = (key_pos.view(1, -1) <= query_pos.view(-1, 1)) & (
        ~evicting.view(-1, 1) | is_sink.view(1, -1)
        | (key_pos.view(1, -1) > query_pos.view(-1, 1) - window))  # (Q, L)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("hql,lhd->qhd", probs, values)
