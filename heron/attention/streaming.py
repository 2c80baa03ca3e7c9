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
"""

from __future__ import annotations

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
    out = torch.empty_like(q)
    if plan.plain is not None:
        idx = plan.plain_tokens
        out[idx] = backend.forward(q[idx], k[idx], v[idx], kv_cache, plan.plain, scale, None)
    idx = plan.streaming_tokens
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    kv_heads, head_dim = k.shape[1], k.shape[2]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, md.slot_mapping[idx], k[idx])
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, md.slot_mapping[idx], v[idx])
    for i in plan.streaming_rows:
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        sinks, window = md.streaming[i]
        out[start:end] = sink_window_attention(
            q[start:end], q_sink[start:end], key_cache, value_cache, md.block_tables[i],
            md.seq_lens_cpu[i], md.block_size, scale, sinks, window)
    return out


class _StreamingPlan:
    """The step split once (shared by every layer): StreamingLLM requests, and the others as
    a metadata of their own for the backend."""

    def __init__(self, md: AttentionMetadata) -> None:
        if md.tree_masks:
            raise ValueError("tree speculation does not combine with StreamingLLM requests")
        qsl = md.query_start_loc_cpu
        self.streaming_rows = [i for i, s in enumerate(md.streaming) if s is not None]
        plain_rows = [i for i, s in enumerate(md.streaming) if s is None]
        device = md.slot_mapping.device
        self.streaming_tokens = _token_index(qsl, self.streaming_rows, device)
        self.plain_tokens = _token_index(qsl, plain_rows, device)
        self.plain = _subset(md, plain_rows, self.plain_tokens) if plain_rows else None


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
