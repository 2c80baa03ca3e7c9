"""GPTQ checkpoints (AutoGPTQ / GPTQModel), loaded as published.

Per linear: ``qweight`` int32 (K / (32 / bits), N), values packed along the input features;
``qzeros`` int32 (G, N / (32 / bits)) packed along the outputs, holding zero - 1 in the v1
``checkpoint_format`` ("gptq", AutoGPTQ's) and the zero itself in v2 ("gptq_v2");
``scales`` (G, N); ``g_idx`` (K,) the group of each input feature (act-order / desc_act
permutes it). w[k, n] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.quant.base import ParamLayout, add_param
from heron.quant.methods.weight_only import Decoded, WeightOnlyIntMethod
from heron.quant.packing import SUPPORTED_BITS, unpack_int32


@dataclass(frozen=True)
class GPTQConfig:
    bits: int
    group_size: int  # -1: one group over all input features
    desc_act: bool
    sym: bool
    zero_offset: int  # 1 for v1 checkpoints (qzeros store zero - 1), 0 for v2

    @classmethod
    def from_dict(cls, qc: dict) -> GPTQConfig:
        bits = int(qc.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits} bits is not supported (4 or 8)")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return cls(bits, int(qc.get("group_size", 128)), bool(qc.get("desc_act", False)),
                   bool(qc.get("sym", True)), 1 if fmt == "gptq" else 0)

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"gptq {self.bits}-bit {group}{' act-order' if self.desc_act else ''}"


class GPTQLinearMethod(WeightOnlyIntMethod):
    name = "gptq"

    def __init__(self, config: GPTQConfig) -> None:
        self.config = config
        self.bits = config.bits

    def _group(self, layer) -> int:
        return layer.in_features if self.config.group_size == -1 else self.config.group_size

    def create_weights(self, layer, dtype) -> None:
        k, n, pack = layer.in_features, layer.out_features, 32 // self.bits
        group = self._group(layer)
        if k % pack or n % pack or (layer.input_sharded and k % group):
            raise ValueError(f"a {k}x{n} GPTQ layer does not fit {self.bits}-bit packing "
                             f"with groups of {group}" + (" on this tensor-parallel rank"
                                                          if layer.input_sharded else ""))
        groups = -(-k // group)  # a last, shorter group when group does not divide K
        if self.config.desc_act and layer.input_sharded:
            raise ValueError("GPTQ act-order (desc_act) checkpoints are not supported with "
                             "tensor parallelism yet (a rank's input features mix groups)")
        one_group = self.config.group_size == -1  # replicated along the input features
        group_layout = ParamLayout(output_dim=1, input_dim=None if one_group else 0,
                                   input_per_element=group)
        add_param(layer, "qweight", (k // pack, n), torch.int32,
                  ParamLayout(output_dim=1, input_dim=0, input_per_element=pack))
        add_param(layer, "qzeros", (groups, n // pack), torch.int32,
                  ParamLayout(output_dim=1, output_per_element=pack,
                              input_dim=group_layout.input_dim, input_per_element=group))
        add_param(layer, "scales", (groups, n), torch.float32, group_layout)
        # one per fused projection: act-order permutations must agree to share one matmul
        add_param(layer, "g_idx", (len(layer.output_sizes), k), torch.int32,
                  ParamLayout(per_shard=True, input_dim=1), optional=True)

    def decode(self, layer) -> Decoded:
        k, n, bits = layer.in_features, layer.out_features, self.bits
        q = unpack_int32(layer.qweight.data, bits, dim=0, size=k).t()  # (N, K)
        zeros = unpack_int32(layer.qzeros.data, bits, dim=1, size=n).to(torch.float32)
        zeros = (zeros + self.config.zero_offset).t()  # (N, G)
        scales = layer.scales.data.t().to(torch.float32)
        g_idx = None
        if "g_idx" in layer.loaded_params:  # global group ids: a row shard's start at 0
            g_idx = layer.g_idx.data[0] - layer.input_start // self._group(layer)
            if not all(torch.equal(row, layer.g_idx.data[0]) for row in layer.g_idx.data):
                raise ValueError("the fused projections of a GPTQ layer have different g_idx "
                                 "(act-order permutations); heron multiplies them as one")
        return Decoded(q, scales, -zeros * scales, self._group(layer), bits, g_idx)
