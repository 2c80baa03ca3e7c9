"""Refuse checkpoints heron cannot run correctly, instead of loading them into garbage.

Contract: a checkpoint either loads exactly (every tensor lands in a parameter, or is on the
short list of tensors known to carry nothing the model needs) or the load fails with a
ValueError that names what heron does not implement. Quantized checkpoints load through
their declared format (``heron.quant.config``); quantization tensors or non-float dtypes in a
checkpoint that declares none fail here, as do tensors whose dtype is not the one the declared
format stores.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Checkpoint tensors heron recomputes or does not need (ColossalAI-trained models and older
# transformers versions saved the rotary caches; tied models may still store lm_head.weight).
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

# Last name component of tensors that hold quantization data (compressed-tensors, HF fp8,
# GPTQ, AWQ, bitsandbytes, kv-cache scales).
QUANT_TENSOR_NAMES = frozenset({
    "weight_scale", "weight_scale_inv", "weight_global_scale", "input_scale",
    "input_global_scale", "output_scale", "k_scale", "v_scale", "weight_zero_point",
    "input_zero_point", "weight_g_idx", "weight_packed", "weight_shape", "qweight", "qzeros",
    "scales", "g_idx", "SCB", "absmax", "quant_map", "nested_absmax", "nested_quant_map",
    "bitsandbytes__nf4", "bitsandbytes__fp4",
})

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# (name, *aliases) of the config keys that describe a non-compressed-tensors quantization
_DETAIL_KEYS = (("bits", "w_bit"), ("group_size", "q_group_size"), ("fmt",),
                ("weight_block_size",), ("load_in_4bit",), ("load_in_8bit",),
                ("bnb_4bit_quant_type",))
_ADVICE = ("a quantized checkpoint needs the quantization_config (gptq, awq or "
           "compressed-tensors) its tensors were written with")


def describe_quantization(qc: dict) -> str:
    """One-line summary of a quantization config: method, then format/scheme or bits/group."""
    method = qc.get("quant_method", "unknown")
    parts = [f"quant_method={method!r}"]
    if method == "compressed-tensors":
        return ", ".join(parts + _describe_compressed_tensors(qc))
    for key, *aliases in _DETAIL_KEYS:
        value = next((qc[k] for k in (key, *aliases) if qc.get(k) not in (None, False)), None)
        if value is not None:
            parts.append(f"{key}={value}")
    return ", ".join(parts)


def _describe_compressed_tensors(qc: dict) -> list[str]:
    """compressed-tensors: the storage format and each group's W<bits>A<bits> scheme."""
    groups = (qc.get("config_groups") or {}).values()
    fmt = qc.get("format") or next((g["format"] for g in groups if g.get("format")), None)
    out = [f"format {fmt!r}"] if fmt else []
    schemes = sorted({_scheme(g) for g in groups if g.get("weights")})
    return out + ([f"scheme {', '.join(schemes)}"] if schemes else [])


def _scheme(group: dict) -> str:
    """e.g. 'W8A8 FP8', 'W8A8 INT8', 'W4A16 INT4' for one compressed-tensors config group."""
    w, a = group["weights"], group.get("input_activations") or {}
    bits = w.get("num_bits", "?")
    kind = "FP" if w.get("type") == "float" else "INT"
    return f"W{bits}A{a.get('num_bits', 16)} {kind}{bits}"


def is_harmless(name: str) -> bool:
    """True for checkpoint tensors heron may skip without changing the model's output."""
    return name.endswith(HARMLESS_SUFFIXES)


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    """ValueError for a tensor that is not plain floating point (int8, fp8, packed int32...)."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"checkpoint tensor {name} has dtype {tensor.dtype}: the checkpoint "
                         f"looks quantized; {_ADVICE}")


def check_quantized_dtype(name: str, tensor, param_dtype: torch.dtype) -> None:
    """ValueError unless a tensor for an integer parameter is integer (zero points and g_idx
    are widened exactly) and one for an fp8 parameter has exactly its dtype: quantized values
    are never cast through floats."""
    integer = not param_dtype.is_floating_point and not tensor.dtype.is_floating_point \
        and tensor.dtype != torch.bool
    if tensor.dtype != param_dtype and not integer:
        raise ValueError(f"checkpoint tensor {name} has dtype {tensor.dtype} where the "
                         f"declared quantization stores {param_dtype}")


def unexpected_tensors_error(names: list[str]) -> ValueError:
    """The error for checkpoint tensors with no matching parameter (count, up to 8 named)."""
    shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    what = (f"checkpoint has {len(names)} tensor{'s' if len(names) > 1 else ''} heron has "
            f"no parameter for ({shown})")
    quant = sorted({n.rsplit(".", 1)[-1] for n in names} & QUANT_TENSOR_NAMES)
    if quant:
        return ValueError(f"{what}; names ending in {', '.join(quant)} hold quantization "
                          f"data: the checkpoint looks quantized; {_ADVICE}")
    return ValueError(f"{what}: does config.json describe this checkpoint?")
