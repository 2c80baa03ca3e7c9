"""What a model's positions allow: the longest context its rope covers (``--max-model-len``
beyond ``max_position_embeddings`` needs rope scaling that reaches it) and whether cached KV
can be shared between sequences (not when a token's rotation depends on its sequence's
length: dynamic NTK, longrope)."""

from __future__ import annotations

import json
import logging
import math

from heron.layers.rope_scaling import LENGTH_DEPENDENT, max_context, rope_type_of
from heron.models.config import ModelArchConfig, rope_parameters_by_layer_type

logger = logging.getLogger(__name__)


def check_max_model_len(arch: ModelArchConfig, max_model_len: int | None,
                        streaming_kv: tuple[int, int] | None = None) -> None:
    """ValueError, naming the fix, when ``max_model_len`` exceeds what the model's positions
    cover: ``max_position_embeddings``, or the original length x factor of its rope scaling
    (linear, dynamic, yarn, longrope, llama3). None (the model's own length) always fits, and
    so does any length under StreamingLLM (``streaming_kv``: its queries see sinks + window
    at most, at in-cache distances) or when every layer slides over a window it covers."""
    native = arch.max_position_embeddings
    covered = max_context(arch.rope_scaling, native)
    if max_model_len is None or max_model_len <= covered:
        return
    if streaming_kv is not None:
        check_streaming_kv(arch, streaming_kv)
        return
    windows = {arch.sliding_window_of(layer) for layer in range(arch.num_layers)}
    if None not in windows and max(windows) <= covered:
        return  # every layer slides: a query sees its window only, at true distances
    kind = rope_type_of(arch.rope_scaling)
    if kind == "default":
        why = f"max_position_embeddings is {native} and the model has no rope scaling"
    else:
        why = f"its {kind} rope scaling covers {covered} tokens"
    example = json.dumps(_override_for(arch, max_model_len))
    raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context: {why}. "
                     f"Pass a --max-model-len of at most {covered}, or extend the context with "
                     f"rope scaling, e.g. --hf-overrides '{example}' (LLM(hf_overrides=...) "
                     f"in Python; the model's quality past its trained length is its own)")


def check_streaming_kv(arch: ModelArchConfig, streaming_kv: tuple[int, int]) -> None:
    """ValueError unless StreamingLLM's cache (sinks + window) fits the model: the in-cache
    distances stay within its positions, and its rotation does not depend on the sequence's
    length (dynamic NTK, longrope)."""
    sinks, window = streaming_kv
    covered = max_context(arch.rope_scaling, arch.max_position_embeddings)
    if sinks + window > covered:
        raise ValueError(f"streaming_kv keeps {sinks} sink tokens + a window of {window}, more "
                         f"than the {covered} positions the model covers")
    kind = rope_type_of(arch.rope_scaling)
    if kind in LENGTH_DEPENDENT:
        raise ValueError(f"streaming_kv does not combine with {kind} rope scaling (its "
                         f"rotation depends on the sequence's length)")


def _override_for(arch: ModelArchConfig, max_model_len: int) -> dict:
    """An ``--hf-overrides`` object whose rope scaling covers ``max_model_len``: yarn from
    the native length for plain RoPE, else the model's own scaling with a larger factor
    (under the config key that holds it)."""
    native = arch.max_position_embeddings
    if arch.rope_scaling is None:
        return {"rope_scaling": {"rope_type": "yarn",
                                 "factor": float(math.ceil(max_model_len / native)),
                                 "original_max_position_embeddings": native}}
    original = arch.rope_scaling.get("original_max_position_embeddings") or native
    change = {"factor": float(math.ceil(max_model_len / original))}
    if arch.hf_config.get("rope_scaling"):
        return {"rope_scaling": change}
    if rope_parameters_by_layer_type(arch.hf_config) is not None:
        return {"rope_parameters": {"full_attention": change}}
    return {"rope_parameters": change}


def prefix_caching_allowed(arch: ModelArchConfig, enabled: bool) -> bool:
    """``enabled``, unless the model's rope makes a token's KV depend on its sequence's
    length (dynamic NTK, longrope): another sequence's cached blocks would then be wrong."""
    kind = rope_type_of(arch.rope_scaling)
    if enabled and kind in LENGTH_DEPENDENT:
        logger.warning("prefix caching is off: with %s rope scaling a token's keys depend on "
                       "the length of its sequence, so cached blocks cannot be shared", kind)
        return False
    return enabled
