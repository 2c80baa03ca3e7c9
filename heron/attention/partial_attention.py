"""Attention over part of a sequence's keys, and the exact merge of such parts.

A query's softmax attention over a union of disjoint key sets is recovered from its
attention over each set and that set's log-sum-exp: with ``lse = logsumexp_r lse_r``,
``out = sum_r exp(lse_r - lse) out_r``. Context parallelism computes the parts on different
ranks (``context_parallel``: KV sharded by block; ``context_parallel_ring``: K/V passed round
a ring). Keys are masked by position: query ``q`` sees keys at positions ``<= q`` (and
``> q - window`` for a sliding-window layer). Computed in float32 whatever the inputs.
"""

from __future__ import annotations

import torch

_MAX_SCORES = 1 << 24  # score elements per query chunk (64 MiB of float32)
_CHUNK_ROWS = 256  # prefill queries per chunk: causal chunks skip the keys after them


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
