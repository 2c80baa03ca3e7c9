"""Per-step attention metadata and the forward context that carries it to the layers.

The runner builds one ``AttentionMetadata`` per step and sets it, together with the KV cache
tensors, as the forward context; model code stays ``forward(input_ids, positions)`` and each
attention layer reads what it needs from ``get_forward_context()``.

Tree attention (speculative decoding's tree verification): ``tree_masks`` maps a request
index ``i`` to a bool ``(Q_i, Q_i)`` CPU tensor, ``Q_i = query_lens_cpu[i]``. The request's
``Q_i`` queries are, as always, its last ``Q_i`` tokens (K/V stored to their slots as usual),
but they are the nodes of a candidate tree rather than a chain: query ``a`` sees the whole
context (keys at sequence index ``< seq_lens[i] - Q_i``) and, among the ``Q_i`` new keys,
key ``b`` iff ``tree_masks[i][a, b]`` (``b`` is an ancestor of ``a`` or ``a`` itself; the
diagonal must be True). Nodes need not be in topological order. A lower-triangular mask is
an ordinary causal chunk; requests absent from the dict are ordinary. Positions (siblings share
a depth) are the caller's; slots are distinct per node. Not combinable with sliding windows
(a ValueError). Every backend honours it (``torch`` is the oracle); steps without trees
(``tree_masks`` None or empty) take exactly the paths they took before.
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
    # request index -> (Q_i, Q_i) bool CPU tensor: which of its own new keys each of its
    # queries sees (see the module docstring); None / absent requests are causal.
    tree_masks: dict[int, torch.Tensor] | None = None
    # (num_tokens,) int64: the sequence length each token's rotary embedding is computed for
    # (length-dependent rope scaling: dynamic NTK, longrope), max(position + 1, prompt
    # length); None: the model needs none (heron.layers.rotary.RotaryEmbedding)
    rope_lengths: torch.Tensor | None = None
    # StreamingLLM (heron.attention.streaming): per request its (sink_tokens, window) or None;
    # None when no request of the step streams. sink_positions (num_tokens,) int64: where
    # each query sits in its StreamingLLM cache (sinks + window - 1; its own position for
    # requests that do not stream): the model rotates a second copy of the queries there,
    # for the sink keys
    streaming: list[tuple[int, int] | None] | None = None
    sink_positions: torch.Tensor | None = None
    # KV cache groups (heron.models.kv_cache_spec): this step as each group sees it (its own
    # slot_mapping and block_tables, the rest shared); None with a single group
    group_views: list[AttentionMetadata] | None = None
    # context parallelism: which of the step's rows this rank computes when its prefill
    # rows are split over the CP ranks (heron.attention.context_parallel_ring.TokenSplit);
    # None: every rank computes every row. The fields above stay the whole step's.
    cp_split: object | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_cpu)

    def tree_rows(self, sliding_window: int | None = None) -> list[int]:
        """The requests whose tree mask changes their attention (``Q_i > 1``), ascending, with
        their masks checked once per step; [] when there are none. Raises ValueError for a
        malformed mask, or when the calling layer's ``sliding_window`` is set in a step with
        tree masks."""
        if not self.tree_masks:
            return []
        if sliding_window is not None:
            raise ValueError("tree attention masks cannot be combined with a sliding window")
        if "tree_rows" not in self.backend_cache:
            for i, mask in self.tree_masks.items():
                if not 0 <= i < self.num_reqs:
                    raise ValueError(f"tree mask for request {i}, but the step has "
                                     f"{self.num_reqs} requests")
                q_len = self.query_lens_cpu[i]
                if mask.dtype != torch.bool or tuple(mask.shape) != (q_len, q_len):
                    raise ValueError(f"tree mask of request {i}: expected a ({q_len}, {q_len}) "
                                     f"bool tensor, got {tuple(mask.shape)} {mask.dtype}")
                if not bool(mask.diagonal().all()):
                    raise ValueError(f"tree mask of request {i}: every node must see itself")
            self.backend_cache["tree_rows"] = sorted(
                i for i in self.tree_masks if self.query_lens_cpu[i] > 1)
        return self.backend_cache["tree_rows"]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer: (2, num_blocks, block_size, num_kv_heads, head_dim)
    backend: object
    # Fused Triton kernels for RMSNorm, rotary and SiLU-and-mul (see heron.layers.dispatch).
    use_triton_ops: bool = False
    # A model may run its decoder layers through heron_cpu's LayerStack (one C++ call per
    # step, heron.models.layer_stack) where it has an exact form for them.
    use_cpu_layer_stack: bool = False
    # KV cache groups: layer -> its group's index into attn_metadata.group_views (None: every
    # layer reads attn_metadata itself)
    layer_groups: list[int] | None = None

    def metadata_of(self, layer_idx: int) -> AttentionMetadata:
        """The metadata of ``layer_idx``'s KV cache group."""
        if self.layer_groups is None:
            return self.attn_metadata
        return self.attn_metadata.group_views[self.layer_groups[layer_idx]]


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
