"""StreamingLLM's attention (``heron.attention.streaming``) against a float64 reference
written the paper's way: raw keys re-rotated at their positions in the cache (sinks first,
then the window), the query at the cache's last position. heron never re-rotates a key:
window keys keep their true positions and the sinks are scored with a second copy of the
query rotated at the cache position (RoPE scores depend only on the distance). Any chunk of
queries (``sink_window_attention``), and whole steps through ``streaming_forward``: batched
decodes of different lengths, sinks and windows beside prefill chunks and requests that do
not stream, under the torch backend (the padded gather) and the cpu backend (the C++
kernel). GQA, paged blocks with the released middle filled with NaN that must never be
read."""

from __future__ import annotations

import pytest
import torch

from heron.attention.streaming import sink_window_attention, streaming_forward
from heron.layers.rotary import apply_rotary, compute_inv_freq

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def _rope(positions: torch.Tensor, dtype=torch.float32):
    inv_freq = compute_inv_freq(DIM, 10000.0, None).double()
    freqs = torch.outer(positions.double(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().unsqueeze(1).to(dtype), emb.sin().unsqueeze(1).to(dtype)


def _reference(q_raw, k_raw, v, seq_len, q_len, sinks, window, scale):
    """float64: each query's cache (sinks + its last ``window`` tokens, or everything while
    that is shorter), re-rotated at in-cache positions."""
    out = []
    for p in range(seq_len - q_len, seq_len):
        kept = list(range(p + 1))
        if p + 1 > sinks + window:
            kept = list(range(sinks)) + list(range(p - window + 1, p + 1))
        n = len(kept)
        cos, sin = _rope(torch.arange(n), torch.float64)
        keys = apply_rotary(k_raw[kept].double(), cos, sin)  # (n, KVH, D)
        query = apply_rotary(q_raw[p - (seq_len - q_len)].double().unsqueeze(0),
                             cos[-1:], sin[-1:])[0]  # (H, D)
        keys = keys.repeat_interleave(HEADS // KV_HEADS, 1)
        values = v[kept].double().repeat_interleave(HEADS // KV_HEADS, 1)
        probs = (torch.einsum("hd,nhd->hn", query, keys) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", probs, values))
    return torch.stack(out)


@pytest.mark.parametrize("sinks,window,seq_len,q_len", [
    (4, 16, 40, 1), (4, 16, 40, 9), (4, 16, 20, 20), (2, 8, 64, 64), (0, 8, 30, 5),
    (1, 5, 12, 3), (6, 3, 33, 7)])
def test_matches_the_rerotated_cache(sinks, window, seq_len, q_len):
    torch.manual_seed(seq_len * 31 + window)
    q_raw = torch.randn(q_len, HEADS, DIM)
    k_raw, v = torch.randn(seq_len, KV_HEADS, DIM), torch.randn(seq_len, KV_HEADS, DIM)
    cos, sin = _rope(torch.arange(seq_len))
    keys = apply_rotary(k_raw, cos, sin)  # stored at true positions, as always
    q = apply_rotary(q_raw, cos[-q_len:], sin[-q_len:])
    sink_pos = torch.full((q_len,), sinks + window - 1)
    q_sink = apply_rotary(q_raw, *_rope(sink_pos))
    # a shuffled paged pool; every slot not holding this sequence is NaN
    num_blocks = -(-seq_len // BLOCK)
    table = torch.randperm(num_blocks + 5)[:num_blocks]
    key_cache = torch.full((num_blocks + 5, BLOCK, KV_HEADS, DIM), float("nan"))
    value_cache = key_cache.clone()
    slots = table[torch.arange(seq_len) // BLOCK] * BLOCK + torch.arange(seq_len) % BLOCK
    key_cache.view(-1, KV_HEADS, DIM)[slots] = keys
    value_cache.view(-1, KV_HEADS, DIM)[slots] = v
    # what the released middle holds is garbage: no query may read it
    first_read = max(sinks, seq_len - q_len - window + 1)
    for pos in range(sinks, first_read):
        key_cache.view(-1, KV_HEADS, DIM)[slots[pos]] = float("nan")
    scale = DIM ** -0.5
    got = sink_window_attention(q, q_sink, key_cache, value_cache, table, seq_len, BLOCK,
                                scale, sinks, window)
    ref = _reference(q_raw, k_raw, v, seq_len, q_len, sinks, window, scale)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


# ---- a whole step through streaming_forward: batched decodes, chunks, plain requests -------
# per request: (streaming (S, W) or None, seq_len, q_len)
MIXED = [((4, 16), 40, 1), ((2, 8), 64, 1), ((0, 8), 30, 1), ((4, 16), 12, 1),
         ((4, 16), 20, 1), ((4, 16), 21, 1), ((6, 3), 100, 1), ((1, 5), 33, 7),
         (None, 25, 1), (None, 18, 6), ((3, 9), 70, 1)]
DECODES_ONLY = [r for r in MIXED if r[0] is not None and r[2] == 1]


def _backend(name: str):
    from heron.attention import get_attention_backend
    from heron.kernels import cpu

    if name == "cpu" and not cpu.load():
        pytest.skip("heron's C++ CPU kernels did not build here")
    return get_attention_backend(name)


def _released(spec, seq_len: int, q_len: int) -> range:
    """Positions of a streaming request no query of its chunk may read."""
    if spec is None:
        return range(0)
    sinks, window = spec
    return range(sinks, max(sinks, seq_len - q_len - window + 1))


def _step(requests, seed: int):
    """A flat step over a shuffled pool of finite garbage, NaN planted (keys and values) in
    each streaming request's released positions and in the unused tail of its last block.
    Returns the step's tensors, its metadata and the float64 reference output."""
    from heron.attention import AttentionMetadata

    torch.manual_seed(seed)
    per_req = [-(-s // BLOCK) for _, s, _ in requests]
    num_blocks = sum(per_req) + 3
    order = torch.randperm(num_blocks - 1) + 1  # block 0: padding, never owned
    key_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM) * 100
    value_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM) * 100
    tables = torch.zeros(len(requests), max(per_req), dtype=torch.long)
    cols = {name: [] for name in ("q", "q_sink", "k", "v", "slots", "ref")}
    scale, used = DIM ** -0.5, 0
    for i, (spec, seq_len, q_len) in enumerate(requests):
        tables[i, :per_req[i]] = order[used:used + per_req[i]]
        used += per_req[i]
        q_raw = torch.randn(q_len, HEADS, DIM)
        k_raw, v = torch.randn(seq_len, KV_HEADS, DIM), torch.randn(seq_len, KV_HEADS, DIM)
        cos, sin = _rope(torch.arange(seq_len))
        keys = apply_rotary(k_raw, cos, sin)  # (seq_len, KVH, D) at true positions
        slots = tables[i][torch.arange(seq_len) // BLOCK] * BLOCK + torch.arange(seq_len) % BLOCK
        new = seq_len - q_len
        key_cache.view(-1, KV_HEADS, DIM)[slots[:new]] = keys[:new]
        value_cache.view(-1, KV_HEADS, DIM)[slots[:new]] = v[:new]
        garbage = list(_released(spec, seq_len, q_len)) + list(
            range(seq_len, per_req[i] * BLOCK) if spec is not None else [])
        flat_tail = tables[i][torch.tensor(garbage, dtype=torch.long) // BLOCK] * BLOCK \
            + torch.tensor(garbage, dtype=torch.long) % BLOCK
        key_cache.view(-1, KV_HEADS, DIM)[flat_tail] = float("nan")
        value_cache.view(-1, KV_HEADS, DIM)[flat_tail] = float("nan")
        q = apply_rotary(q_raw, cos[new:], sin[new:])
        sink_pos = torch.arange(new, seq_len) if spec is None else \
            torch.full((q_len,), sum(spec) - 1)
        cols["q"].append(q)
        cols["q_sink"].append(apply_rotary(q_raw, *_rope(sink_pos)))
        cols["k"].append(keys[new:])
        cols["v"].append(v[new:])
        cols["slots"].append(slots[new:])
        sinks, window = spec if spec is not None else (0, seq_len)  # plain: never evicts
        cols["ref"].append(_reference(q_raw, k_raw, v, seq_len, q_len, sinks, window, scale))
    q_lens = [r[2] for r in requests]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.cat(cols["slots"]), block_tables=tables,
        seq_lens=torch.tensor([r[1] for r in requests]), query_start_loc=torch.tensor(starts),
        query_start_loc_cpu=starts, query_lens_cpu=q_lens,
        seq_lens_cpu=[r[1] for r in requests], block_size=BLOCK,
        streaming=[r[0] for r in requests])
    kv_cache = torch.stack([key_cache, value_cache])
    tensors = [torch.cat(cols[name]) for name in ("q", "q_sink", "k", "v")]
    return tensors, kv_cache, md, torch.cat(cols["ref"])


@pytest.mark.parametrize("requests", [MIXED, DECODES_ONLY], ids=["mixed", "decodes-only"])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_a_batched_step_matches_the_rerotated_cache(backend_name, requests):
    """Decodes of different lengths, sinks and windows (before, at and after the first
    eviction; no sinks; more sinks than window) in one batch, beside a streaming prefill chunk
    and requests that do not stream; twice, as two layers of one step share its plan."""
    backend = _backend(backend_name)
    (q, q_sink, k, v), kv_cache, md, ref = _step(requests, seed=len(requests))
    for _ in range(2):
        got = streaming_forward(backend, q, q_sink, k, v, kv_cache, md, DIM ** -0.5, None)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_cpu_kernel_before_eviction_is_the_plain_decode():
    """A streaming decode that has evicted nothing yet gets the very bits of the cpu backend's
    decode of the same request (its keys all scored with q, in the same order)."""
    backend = _backend("cpu")
    requests = [((4, 16), 19, 1), ((8, 120), 100, 1)]
    (q, q_sink, k, v), kv_cache, md, _ = _step(requests, seed=3)
    got = streaming_forward(backend, q, q_sink, k, v, kv_cache.clone(), md, DIM ** -0.5, None)
    md.streaming = None
    plain = backend.forward(q, k, v, kv_cache, md, DIM ** -0.5, None)
    assert torch.equal(got, plain)
