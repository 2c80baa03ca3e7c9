"""Attention backends by name; every backend reads the same ``AttentionMetadata``."""

from __future__ import annotations

from heron.attention.metadata import (AttentionMetadata, ForwardContext, current_forward_context,
                                      forward_context, get_forward_context)
from heron.attention.registry import BACKEND_NAMES, get_attention_backend, resolve_backend_name

__all__ = ["AttentionMetadata", "ForwardContext", "forward_context", "get_forward_context",
           "current_forward_context", "get_attention_backend", "resolve_backend_name",
           "BACKEND_NAMES"]
