"""GGUF weights kept quantized: each projection's blocks arrive decoded
(``gguf_blocks.QuantizedRows``: values, a scale and a min per group, exactly the numbers
``gguf.quants.dequantize`` would multiply out) and are repacked into one ``GroupedIntWeight``
per layer. The projections of a fused layer may use different ggml types (Q4_K_M files store
some v projections as Q6_K): they are stored at the widest bit width and the finest group
size among them, which represents every one exactly. A float tensor in a fused layer (F16 /
F32 projections) makes the whole layer float.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from heron.quant.base import LinearMethod, ParamLayout, add_param
from heron.quant.gguf_blocks import QuantizedRows
from heron.quant.int_layout import GroupedIntWeight, quant_linear


class GGUFLinearMethod(LinearMethod):
    name = "gguf"

    def create_weights(self, layer, dtype) -> None:
        # a placeholder: the decoded shards land in layer.gguf_shards as they load
        add_param(layer, "weight", (0,), torch.uint8, ParamLayout(output_dim=None,
                                                                  input_dim=None))
        layer.gguf_shards = {}

    def load_weight(self, layer, name: str, tensor, shard_id) -> None:
        if name != "weight":
            raise ValueError(f"GGUF linear layers have no {name!r} tensor")
        shard = shard_id or 0
        rows = layer.output_sizes[shard]
        tensor = tensor.narrow(0, layer.shard_start(shard), rows)
        if layer.input_sharded:
            tensor = tensor.narrow(1, layer.input_start, layer.in_features)
        layer.gguf_shards[shard] = tensor

    def process_weights_after_loading(self, layer) -> None:
        parts = [layer.gguf_shards[i] for i in range(len(layer.output_sizes))]
        del layer.gguf_shards
        if not all(isinstance(p, QuantizedRows) for p in parts):
            layer.dense = torch.cat([p.dequantize() if isinstance(p, QuantizedRows)
                                     else _plain(p) for p in parts])
            layer.grouped = None
            return
        bits = max(p.bits for p in parts)
        group = math.gcd(*(p.group_size for p in parts))
        parts = [p.regroup(group) for p in parts]
        layer.dense = None
        layer.grouped = GroupedIntWeight.from_values(
            torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
            torch.cat([p.mins for p in parts]), group, bits)
        layer.weight.data = torch.empty(0, dtype=torch.uint8)

    def apply(self, layer, x, bias=None):
        if layer.grouped is None:
            y = F.linear(x.to(layer.dense.dtype), layer.dense).to(x.dtype)
        else:
            y = quant_linear(x, layer.grouped).to(x.dtype)
        return y if bias is None else y + bias

    def weight_bytes(self, layer) -> int:
        if layer.grouped is None:
            return layer.dense.numel() * layer.dense.element_size()
        return layer.grouped.nbytes

    def describe(self) -> str:
        return "gguf"


def _plain(tensor) -> torch.Tensor:
    t = tensor.materialize() if hasattr(tensor, "materialize") else tensor
    return t.to(torch.float32)
