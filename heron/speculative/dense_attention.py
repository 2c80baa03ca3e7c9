"""A KV-cache-free attention backend for training: plain causal SDPA over a padded batch.

Model code calls ``heron.layers.attention.attention`` with a flat batch; under a forward
context whose backend is ``DenseCausalAttention(batch, seq_len)`` that flat batch is read as
``batch`` sequences of ``seq_len`` rows each (row ``b * seq_len + s`` is token ``s`` of
sequence ``b``), and each row attends to the rows of its own sequence at or before it. No KV
cache is read or written (``kv_cache`` and the metadata are ignored), and autograd flows
through it, so the same module code that runs paged inference trains on full sequences.

Padding sits at the end of a sequence: under a causal mask it never changes an earlier row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseCausalAttention:
    """The backend interface of ``heron.attention`` (``forward(q, k, v, kv_cache, md, scale,
    sliding_window)``) for ``batch`` sequences of ``seq_len`` rows, flattened."""

    name = "dense-causal"

    def __init__(self, batch: int, seq_len: int) -> None:
        self.batch, self.seq_len = batch, seq_len

    def forward(self, q, k, v, kv_cache=None, md=None, scale: float | None = None,
                sliding_window: int | None = None) -> torch.Tensor:
        """q: (B * S, H, D); k, v: (B * S, KVH, D) -> (B * S, H, D)."""
        b, s = self.batch, self.seq_len
        if q.shape[0] != b * s:
            raise ValueError(f"{q.shape[0]} rows, expected batch {b} x seq_len {s}")
        group = q.shape[1] // k.shape[1]
        # (B, heads, S, D); KV heads repeated for grouped-query attention
        qt = q.view(b, s, *q.shape[1:]).transpose(1, 2)
        kt = k.view(b, s, *k.shape[1:]).transpose(1, 2).repeat_interleave(group, 1)
        vt = v.view(b, s, *v.shape[1:]).transpose(1, 2).repeat_interleave(group, 1)
        if sliding_window is None:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        else:
            pos = torch.arange(s, device=q.device)
            mask = (pos.view(1, -1) <= pos.view(-1, 1)) & \
                (pos.view(1, -1) > pos.view(-1, 1) - sliding_window)
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).reshape(q.shape)
