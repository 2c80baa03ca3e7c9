"""StreamingLLM's attention (``heron.attention.streaming.sink_window_attention``) against a
float64 reference written the paper's way: raw keys re-rotated at their positions in the
cache (sinks first, then the window), the query at the cache's last position. heron never
re-rotates a key: window keys keep their true positions and the sinks are scored with a
second copy of the query rotated at the cache position (RoPE scores depend only on the
distance). Any chunk of queries, GQA, paged blocks with the released middle filled with
garbage that must never be read."""

from __future__ import annotations

import pytest
import torch

from heron.attention.streaming import sink_window_attention
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
