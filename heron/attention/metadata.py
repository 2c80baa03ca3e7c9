"""Per-step attention metadata and the forward context that carries it to the layers.

The runner builds one ``AttentionMetadata`` per step and sets it, together with the KV cache
tensors, as the forward context; model code stays ``forward(input_ids, positions)`` and each
attention layer reads what it needs from ``get_forward_context()``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    """Flat batch layout of one step: request ``i`` owns tokens
    ``query_start_loc[i]:query_start_loc[i + 1]`` of the flat ``(num_tokens, ...)`` tensors.

    ``seq_lens[i]`` counts the request's tokens whose KV exists after this step (prefix already
    in cache + this step's tokens); its queries sit at the last ``query_lens[i]`` positions.
    """

    slot_mapping: torch.Tensor  # (num_tokens,) int64: flat slot of each token in the KV pool
    block_tables: torch.Tensor  # (num_reqs, max_blocks) int64, padded with 0
    seq_lens: torch.Tensor  # (num_reqs,) int64
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int64
    query_start_loc_cpu: list[int]
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Backend-private, per-step derived data (computed once, reused by every layer).
    backend_cache: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_cpu)


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer: (2, num_blocks, block_size, num_kv_heads, head_dim)
    backend: object
    # Fused Triton kernels for RMSNorm, rotary and SiLU-and-mul (see heron.layers.dispatch).
    use_triton_ops: bool = False


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention called outside of a forward context (set by the runner)")
    return _context


def current_forward_context() -> ForwardContext | None:
    """The context of the step being run, or None outside the runner's forward."""
    return _context


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _context
    previous, _context = _context, ctx
    try:
        yield
    finally:
        _context = previous
