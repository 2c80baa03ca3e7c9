"""Attention backends by name; every backend reads the same ``AttentionMetadata``."""

from __future__ import annotations

from heron.attention.metadata import (AttentionMetadata, ForwardContext, forward_context,
                                      get_forward_context)
from heron.attention.torch_backend import TorchAttentionBackend

_BACKENDS = {"torch": TorchAttentionBackend}


def get_attention_backend(name: str):
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}") from None


__all__ = ["AttentionMetadata", "ForwardContext", "forward_context", "get_forward_context",
           "get_attention_backend"]
