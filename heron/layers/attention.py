"""The attention call site of every model layer: ``attention(q, k, v, layer_idx, ...)`` runs
the step's backend (from the forward context) on the layer's KV cache.

In eager mode it calls the backend directly. While dynamo traces (``torch.compile`` of the
model forward, ``heron.worker.compiled_forward``) it emits ``heron::attention``, an opaque
custom op that reads the forward context at run time, so per-step metadata (Python lists,
block tables) and the KV cache tensors never enter the graph and never cause a recompile.
"""

from __future__ import annotations

import torch

from heron.attention.metadata import get_forward_context
from heron.attention.streaming import streaming_forward


@torch.library.custom_op("heron::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                  scale: float, sliding_window: int) -> torch.Tensor:
    """The backend call of one layer. It also writes k, v into the context's KV cache, a side
    effect the graph does not see (the cache is not an argument): the op's output depends on
    it and every later layer on that output, so it is never reordered or dropped."""
    ctx = get_forward_context()
    out = ctx.backend.forward(q, k, v, ctx.kv_caches[layer_idx], ctx.metadata_of(layer_idx),
                              scale, sliding_window or None)
    return out.contiguous()  # the layout the fake promises (a no-op for heron's backends)


@_attention_op.register_fake
def _(q, k, v, layer_idx, scale, sliding_window):
    return q.new_empty(q.shape)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float,
              sliding_window: int | None, q_sink: torch.Tensor | None = None) -> torch.Tensor:
    """q: (T, H, D), k, v: (T, KVH, D) -> (T, H, D) through the forward context's backend.
    ``q_sink`` (T, H, D): q rotated at StreamingLLM cache positions, given in steps with
    StreamingLLM requests (``heron.attention.streaming``)."""
    if torch.compiler.is_compiling():
        if q_sink is not None:
            raise NotImplementedError("StreamingLLM requests run eagerly")
        return _attention_op(q, k, v, layer_idx, scale, sliding_window or 0)
    ctx = get_forward_context()
    md = ctx.metadata_of(layer_idx)
    if md is not None and md.streaming is not None:
        return streaming_forward(ctx.backend, q, q_sink, k, v, ctx.kv_caches[layer_idx], md,
                                 scale, sliding_window)
    return ctx.backend.forward(q, k, v, ctx.kv_caches[layer_idx], md, scale, sliding_window)
