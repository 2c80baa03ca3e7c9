"""compressed-tensors checkpoints (llm-compressor's output), loaded as published.

``quantization_config.config_groups`` give each target (``Linear``, a module name or an
``re:`` pattern) a scheme; ``ignore`` lists modules left in float. Formats:

* ``pack-quantized`` (W4A16 / W8A16): ``weight_packed`` int32 (N, K / (32 / bits)) holding
  value + 2**(bits-1) packed along the input; ``weight_scale`` (N, G); optional
  ``weight_zero_point`` int32 (N / (32 / bits), G) packed along the output the same way;
  ``weight_shape``; ``weight_g_idx`` for act-order. w = scale * (v - zero).
* ``int-quantized`` (W8A8 int8, SmoothQuant's output; W8A16): ``weight`` int8 (N, K),
  ``weight_scale`` (N, 1) per channel or one per tensor; activations int8 per token
  (dynamic) or with a stored ``input_scale`` (static).
* ``float-quantized`` (FP8): ``weight`` float8_e4m3fn (N, K), ``weight_scale`` per channel
  (N, 1) or per tensor; activations FP8 per token (dynamic) or per tensor (``input_scale``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from heron.quant.base import ParamLayout, VECTOR, add_param
from heron.quant.methods.activation_quant import W8A8Int8Method, FP8LinearMethod
from heron.quant.methods.weight_only import Decoded, WeightOnlyIntMethod
from heron.quant.packing import unpack_int32

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Scheme:
    """One config group: weights' and (optionally) input activations' QuantizationArgs."""

    targets: tuple[str, ...]
    weights: dict
    activations: dict | None
    format: str

    @property
    def weight_bits(self) -> int:
        return int(self.weights.get("num_bits", 8))

    def describe(self) -> str:
        a = self.activations
        kind = "fp" if self.weights.get("type") == "float" else "int"
        act = f"A{a.get('num_bits', 8)}" if a else "A16"
        return f"W{self.weight_bits}{act} {kind}{self.weight_bits} {self.format}"


def _matches(target: str, module_name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module_name) is not None
    return target == module_name or target in ("Linear", "torch.nn.Linear")


@dataclass(frozen=True)
class CompressedTensorsConfig:
    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...]

    @classmethod
    def from_dict(cls, qc: dict) -> CompressedTensorsConfig:
        default_format = qc.get("format")
        schemes = []
        for group in (qc.get("config_groups") or {}).values():
            fmt = group.get("format") or default_format
            if fmt not in FORMATS:
                raise ValueError(f"compressed-tensors format {fmt!r} is not supported "
                                 f"({', '.join(FORMATS)})")
            if not group.get("weights"):
                raise ValueError("compressed-tensors groups without weight quantization "
                                 "(activations only) are not supported")
            schemes.append(Scheme(tuple(group.get("targets", ["Linear"])), group["weights"],
                                  group.get("input_activations"), fmt))
        if not schemes:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        return cls(tuple(schemes), tuple(qc.get("ignore") or ()))

    def describe(self) -> str:
        return "compressed-tensors " + ", ".join(sorted({s.describe() for s in self.schemes}))

    def scheme_for(self, module_name: str) -> Scheme | None:
        if any(_matches(t, module_name) and t not in ("Linear", "torch.nn.Linear")
               for t in self.ignore):
            return None
        return next((s for s in self.schemes if any(_matches(t, module_name)
                                                    for t in s.targets)), None)

    def linear_method(self, module_names: list[str]):
        schemes = [self.scheme_for(name) for name in module_names]
        if any(s != schemes[0] for s in schemes):
            raise ValueError(f"the fused projections {module_names} are quantized "
                             f"differently; heron fuses them into one layer")
        scheme = schemes[0]
        return None if scheme is None else make_method(scheme)


def make_method(scheme: Scheme):
    w, a = scheme.weights, scheme.activations
    if w.get("type") == "float":
        if scheme.weight_bits != 8:
            raise ValueError(f"float weights of {scheme.weight_bits} bits are not supported")
        return FP8LinearMethod(w.get("strategy", "tensor"), _activation_mode(a, "float"))
    if scheme.format == "pack-quantized":
        if a:
            raise ValueError("pack-quantized weights with quantized activations are not "
                             "supported")
        return PackQuantizedMethod(scheme.weight_bits, w)
    if scheme.weight_bits != 8:
        raise ValueError(f"int-quantized weights of {scheme.weight_bits} bits are not "
                         f"supported (8)")
    return W8A8Int8Method(w.get("strategy", "channel"), _activation_mode(a, "int"))


def _activation_mode(a: dict | None, kind: str) -> str | None:
    """None (weight-only), 'dynamic' (per-token scales at run time) or 'static' (stored)."""
    if not a:
        return None
    if a.get("type", kind) != kind or int(a.get("num_bits", 8)) != 8:
        raise ValueError(f"input activations {a} are not supported with {kind} weights")
    if not a.get("symmetric", True):
        raise ValueError("asymmetric activation quantization is not supported")
    if a.get("dynamic"):
        if a.get("strategy", "token") != "token":
            raise ValueError(f"dynamic activation strategy {a.get('strategy')!r} is not "
                             f"supported (token)")
        return "dynamic"
    if a.get("strategy", "tensor") != "tensor":
        raise ValueError(f"static activation strategy {a.get('strategy')!r} is not supported "
                         f"(tensor)")
    return "static"


class PackQuantizedMethod(WeightOnlyIntMethod):
    name = "compressed-tensors pack-quantized"

    def __init__(self, bits: int, weights: dict) -> None:
        if bits not in (4, 8):
            raise ValueError(f"pack-quantized weights of {bits} bits are not supported (4, 8)")
        strategy = weights.get("strategy", "group")
        if strategy not in ("group", "channel"):
            raise ValueError(f"pack-quantized strategy {strategy!r} is not supported")
        self.bits = bits
        self.group_size = int(weights.get("group_size") or -1) if strategy == "group" else -1

    def create_weights(self, layer, dtype) -> None:
        k, n, pack = layer.in_features, layer.out_features, 32 // self.bits
        group = k if self.group_size == -1 else self.group_size
        if k % pack or k % group:
            raise ValueError(f"a {k}x{n} layer does not fit {self.bits}-bit packing with "
                             f"groups of {group}")
        group_dim = None if self.group_size == -1 else 1
        add_param(layer, "weight_packed", (n, k // pack), torch.int32,
                  ParamLayout(output_dim=0, input_dim=1, input_per_element=pack))
        add_param(layer, "weight_scale", (n, k // group), torch.float32,
                  ParamLayout(output_dim=0, input_dim=group_dim, input_per_element=group))
        add_param(layer, "weight_zero_point", (-(-n // pack), k // group), torch.int32,
                  ParamLayout(output_dim=0, output_per_element=pack, input_dim=group_dim,
                              input_per_element=group), optional=True)
        add_param(layer, "weight_g_idx", (k,), torch.int32,
                  ParamLayout(output_dim=None, input_dim=0), optional=True)
        add_param(layer, "weight_shape", (len(layer.output_sizes), 2), torch.int64,
                  ParamLayout(per_shard=True), optional=True)

    def decode(self, layer) -> Decoded:
        k, n, bits = layer.in_features, layer.out_features, self.bits
        q = unpack_int32(layer.weight_packed.data, bits, dim=1, size=k)  # (N, K) value + 2**(b-1)
        scales = layer.weight_scale.data.to(torch.float32)
        if "weight_zero_point" in layer.loaded_params:
            zeros = unpack_int32(layer.weight_zero_point.data, bits, dim=0, size=n)
            zeros = zeros.to(torch.float32)
        else:
            zeros = torch.full_like(scales, float(1 << (bits - 1)))
        g_idx = layer.weight_g_idx.data if "weight_g_idx" in layer.loaded_params else None
        return Decoded(q, scales, -zeros * scales, k // scales.shape[1], bits, g_idx)
