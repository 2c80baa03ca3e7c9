"""Weight-only integer methods (W4A16, W8A16): whatever the format packs, after loading the
weight becomes one ``GroupedIntWeight`` (values, and a scale and a min per group) that
``int_layout.quant_linear`` multiplies; activations stay float.

A format's method says which parameters it loads (``create_weights``) and how they decode
into values, scales and mins (``decode``); this base class does the rest, including
act-order: input features permuted so each group is contiguous, and the same permutation
applied to x before the matmul.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from heron.quant.base import LinearMethod
from heron.quant.int_layout import GroupedIntWeight, quant_linear


class Decoded:
    """q (N, K) integers in [0, 2**bits); scales, mins float (N, K // group_size); ``g_idx``
    (K,) the group of each input feature, or None for sequential groups."""

    def __init__(self, q, scales, mins, group_size: int, bits: int, g_idx=None) -> None:
        self.q, self.scales, self.mins = q, scales, mins
        self.group_size, self.bits, self.g_idx = group_size, bits, g_idx


def sequential_groups(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k) // group_size


def _whole_groups(scales, mins, group_size: int, k: int):
    """GPTQ allows a last, shorter group (K = 576 with groups of 128); the kernel wants K a
    multiple of the group: split groups into gcd(group, K) and drop what lies past K (the
    same numbers, repeated)."""
    if k % group_size == 0:
        return scales, mins, group_size
    finer = math.gcd(group_size, k)
    repeat, keep = group_size // finer, k // finer
    return (scales.repeat_interleave(repeat, dim=1)[:, :keep],
            mins.repeat_interleave(repeat, dim=1)[:, :keep], finer)


class WeightOnlyIntMethod(LinearMethod):
    """Base for GPTQ, AWQ, compressed-tensors pack-quantized and GGUF."""

    bits = 4

    def decode(self, layer: nn.Module) -> Decoded:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        decoded = self.decode(layer)
        q = decoded.q
        layer.input_perm = None
        g_idx = decoded.g_idx
        if g_idx is not None and not torch.equal(
                g_idx.long(), sequential_groups(q.shape[1], decoded.group_size)):
            perm = torch.argsort(g_idx.long(), stable=True)
            if not torch.equal(g_idx.long()[perm], sequential_groups(q.shape[1],
                                                                     decoded.group_size)):
                raise ValueError(f"g_idx does not assign {decoded.group_size} input features "
                                 f"to each group: not a GPTQ act-order permutation")
            q, layer.input_perm = q[:, perm], perm
        scales, mins, group = _whole_groups(decoded.scales, decoded.mins, decoded.group_size,
                                            q.shape[1])
        layer.grouped = GroupedIntWeight.from_values(q.to(torch.uint8), scales, mins, group,
                                                     decoded.bits)
        for name in [n for n in layer.param_layouts if n != "bias"]:
            delattr(layer, name)  # the checkpoint's packing is not needed any more
            del layer.param_layouts[name]

    def apply(self, layer, x, bias=None):
        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        y = quant_linear(x, layer.grouped).to(x.dtype)
        return y if bias is None else y + bias

    def stack_form(self, layer):
        return layer.grouped.stack_form() if layer.input_perm is None else None

    def use_int8_activations(self, layer) -> bool:
        return layer.grouped.use_int8_activations()

    def weight_bytes(self, layer) -> int:
        return layer.grouped.nbytes
