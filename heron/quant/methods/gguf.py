"""GGUF weights kept quantized: each projection's blocks arrive decoded
(``gguf_blocks.QuantizedRows``: values, a scale and a min per group, exactly the numbers
``gguf.quants.dequantize`` would multiply out) and are repacked into one ``GroupedIntWeight``
per layer. The projections of a fused layer may use different ggml types (Q4_K_M files store
some v projections as Q6_K): they are stored at the widest bit width and the finest group
size among them, which represents every one exactly. A float tensor in a fused layer (F16 /
F32 projections) makes the whole layer float.

The vocabulary table (token embedding, and the LM head, tied or not) kept quantized is
``GGUFEmbeddingMethod``: rows dequantized on lookup, the grouped-integer matmul as a head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from heron.quant.base import LinearMethod, ParamLayout, StackLinear, add_param
from heron.quant.gguf_blocks import QuantizedRows
from heron.quant.int_layout import GroupedIntWeight, quant_linear, unpack_values


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

    def stack_form(self, layer):
        if layer.grouped is not None:
            return layer.grouped.stack_form()
        return StackLinear.plain(layer.dense)

    def use_int8_activations(self, layer) -> bool:
        return layer.grouped is not None and layer.grouped.use_int8_activations()

    def weight_bytes(self, layer) -> int:
        if layer.grouped is None:
            return layer.dense.numel() * layer.dense.element_size()
        return layer.grouped.nbytes

    def describe(self) -> str:
        return "gguf"


class GGUFEmbeddingMethod(LinearMethod):
    """A vocabulary shard kept quantized: one ``GroupedIntWeight`` ``table`` (shard rows,
    hidden), zero rows past the real vocabulary; the layer's float ``weight`` stays empty
    (only its dtype is read). A tied LM head shares this method, and so the table."""

    name = "gguf"

    def __init__(self, table: GroupedIntWeight) -> None:
        self.table = table

    @classmethod
    def from_rows(cls, rows: QuantizedRows, shard_rows: int) -> GGUFEmbeddingMethod:
        """This rank's rows (real vocabulary only), padded with zero rows to ``shard_rows``."""
        pad = shard_rows - rows.shape[0]
        q, scales, mins = (F.pad(t, (0, 0, 0, pad)) for t in (rows.q, rows.scales, rows.mins))
        return cls(GroupedIntWeight.from_values(q, scales, mins, rows.group_size, rows.bits))

    def embedding(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) local row ids -> (T, hidden) dequantized rows in the layer's dtype."""
        w = self.table
        q = unpack_values(w.qweight[ids], w.bits, w.in_features).to(torch.float32)
        q = q.view(ids.shape[0], -1, w.group_size)  # (T, groups, group_size)
        rows = q * w.scales[ids].unsqueeze(-1) + w.mins[ids].unsqueeze(-1)
        return rows.view(ids.shape[0], w.in_features).to(layer.weight.dtype)

    def apply(self, layer, x, bias=None):
        """x (N, hidden) -> float32 (N, shard rows): the LM head's logits."""
        y = quant_linear(x, self.table)
        return y if bias is None else y + bias

    def use_int8_activations(self, layer) -> bool:
        return self.table.use_int8_activations()  # the head's matmul; lookups stay exact

    def weight_bytes(self, layer) -> int:
        return self.table.nbytes


def _plain(tensor) -> torch.Tensor:
    t = tensor.materialize() if hasattr(tensor, "materialize") else tensor
    return t.to(torch.float32)
