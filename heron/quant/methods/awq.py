"""AWQ GEMM checkpoints (AutoAWQ, ``version: gemm``), loaded as published.

Per linear: ``qweight`` int32 (K, N / 8) and ``qzeros`` int32 (G, N / 8), both packed along
the output features in AutoAWQ's order (nibble i of a word holds column ``AWQ_ORDER[i]``);
``scales`` (G, N). w[k, n] = scales[g, n] * (q[k, n] - zero[g, n]), g = k // group_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.quant.base import ParamLayout, add_param
from heron.quant.methods.weight_only import Decoded, WeightOnlyIntMethod
from heron.quant.packing import AWQ_ORDER, unpack_int32


@dataclass(frozen=True)
class AWQConfig:
    bits: int
    group_size: int

    @classmethod
    def from_dict(cls, qc: dict) -> AWQConfig:
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ValueError(f"AWQ {bits}-bit {version!r} is not supported (4-bit gemm)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ without zero points is not supported")
        return cls(bits, int(qc.get("group_size", qc.get("q_group_size", 128))))

    def describe(self) -> str:
        return f"awq {self.bits}-bit g{self.group_size}"


class AWQLinearMethod(WeightOnlyIntMethod):
    name = "awq"

    def __init__(self, config: AWQConfig) -> None:
        self.config = config
        self.bits = config.bits

    def create_weights(self, layer, dtype) -> None:
        k, n, group = layer.in_features, layer.out_features, self.config.group_size
        group = k if group == -1 else group
        if n % 8 or k % group:
            raise ValueError(f"a {k}x{n} AWQ layer does not fit 4-bit packing with groups "
                             f"of {group}")
        packed = ParamLayout(output_dim=1, output_per_element=8, input_dim=0,
                             input_per_element=1)
        add_param(layer, "qweight", (k, n // 8), torch.int32, packed)
        add_param(layer, "qzeros", (k // group, n // 8), torch.int32,
                  ParamLayout(output_dim=1, output_per_element=8, input_dim=0,
                              input_per_element=group))
        add_param(layer, "scales", (k // group, n), torch.float32,
                  ParamLayout(output_dim=1, input_dim=0, input_per_element=group))

    def decode(self, layer) -> Decoded:
        n = layer.out_features
        q = unpack_int32(layer.qweight.data, 4, dim=1, size=n, order=AWQ_ORDER).t()
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, size=n, order=AWQ_ORDER).t()
        scales = layer.scales.data.t().to(torch.float32)
        return Decoded(q, scales, -zeros.to(torch.float32) * scales,
                       layer.in_features // scales.shape[1], 4)
