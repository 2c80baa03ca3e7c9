"""Float64 torch references for every kernel: the oracle of the kernel tests and of
``heron check-kernels``. Written for clarity (per-request loops, explicit masks), not speed.

Each takes the kernel's inputs (any dtype, any device) and returns float64 results.
"""

from __future__ import annotations

import torch


def max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| over all elements (a normwise relative error; elementwise
    ratios blow up where the reference is near zero)."""
    ref = ref.double()
    diff = (out.double().cpu() - ref.cpu()).abs().max().item() if ref.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return diff / scale if scale > 0 else diff


def gather_context(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """cache: (num_blocks, block_size, KVH, D) -> (seq_len, KVH, D) float64, position order."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len)
    blocks = torch.tensor(block_table, dtype=torch.long)[pos // block_size]  # (seq_len,)
    return cache[blocks.to(cache.device), (pos % block_size).to(cache.device)].double()


def attention_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  sliding_window: int | None) -> torch.Tensor:
    """q: (Q, H, D) for the last Q of L positions; keys, values: (L, KVH, D) -> (Q, H, D)."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # (L, H, D)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # (H, Q, L)
    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)  # (Q, 1)
    k_pos = torch.arange(seq_len).unsqueeze(0)  # (1, L)
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: list[int], seq_lens: list[int], block_tables: list[list[int]],
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: (T, H, D) flat batch; request i owns rows query_start_loc[i]:[i+1], the last
    positions of its seq_lens[i] keys -> (T, H, D) float64."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        keys = gather_context(key_cache, block_tables[i], seq_len)
        values = gather_context(value_cache, block_tables[i], seq_len)
        out[start:end] = attention_one(q[start:end], keys, values, scale, sliding_window)
    return out


def store_kv(k, v, key_cache, value_cache, slot_mapping: list[int]):
    """Caches after writing token t's k, v at slot_mapping[t] (negative = skipped), float64."""
    key_out, value_out = key_cache.double().clone(), value_cache.double().clone()
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping):
        if slot >= 0:
            key_out[slot // block_size, slot % block_size] = k[t].double()
            value_out[slot // block_size, slot % block_size] = v[t].double()
    return key_out, value_out


def rms_norm(x, weight, eps: float, residual=None):
    """norm(x), or (norm(x + residual), x + residual), all in float64."""
    h = x.double() if residual is None else x.double() + residual.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return normed if residual is None else (normed, h)


def apply_rotary(x, cos, sin):
    """x: (T, heads, D), cos/sin: (T, 1, D) -> x * cos + rotate_half(x) * sin, float64."""
    x = x.double()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.double() + torch.cat((-x2, x1), dim=-1) * sin.double()


def silu_and_mul(x):
    """(..., 2d) -> (..., d) float64."""
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up
