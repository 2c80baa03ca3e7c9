"""heron's canonical grouped integer weight: the one layout every integer checkpoint format
(GPTQ, AWQ, compressed-tensors W4A16, GGUF Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / Q8_0) is
converted into, and what the CPU kernel ``torch.ops.heron_cpu.quant_linear`` multiplies.

``GroupedIntWeight`` holds one layer's unsigned values q (N, K), packed, with a float32 scale
and min per row and group, ``w = q * scale + min``; ``heron.kernels.int_pack`` defines the
packing and the reference dequantization. ``quant_linear`` multiplies x by it on CPU (heron's
C++ kernel), on CUDA (Triton) or anywhere (torch, a tile at a time).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from heron.kernels.int_pack import (  # noqa: F401 - re-exported: the layout's functions
    MAX_BITS, MIN_BITS, NIBBLE_MAX_BITS, check_groups, dequantize, pack_values, packed_width,
    unpack_values)
from heron.quant.base import StackLinear

_FALLBACK_TILE_FLOATS = 1 << 22  # the torch fallback dequantizes ~16 MiB of weights at a time
INT8_BLOCK = 32  # features per activation scale on the 8-bit activation path


@dataclass
class GroupedIntWeight:
    """One linear layer's weight in the grouped integer layout (see the module docstring)."""

    qweight: torch.Tensor  # uint8 (out_features, packed_width(bits, in_features))
    scales: torch.Tensor  # float32 (out_features, in_features // group_size)
    mins: torch.Tensor  # float32, same shape
    group_size: int
    bits: int
    in_features: int
    out_features: int
    # multiply on CPU with activations rounded to 8 bits per 32 features and integer dot
    # products (heron_cpu::quant_linear_int8): faster, not exact (--cpu-int8-dot)
    int8_activations: bool = False

    def __post_init__(self) -> None:
        k = check_groups(self.qweight, self.scales, self.mins, self.group_size, self.bits)
        if (k, self.qweight.shape[0]) != (self.in_features, self.out_features):
            raise ValueError(f"in_features / out_features ({self.in_features}, "
                             f"{self.out_features}) disagree with the tensors ({k}, "
                             f"{self.qweight.shape[0]})")

    @classmethod
    def from_values(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    group_size: int, bits: int) -> GroupedIntWeight:
        """From unpacked values q (N, K) in [0, 2**bits) and per-group scales and mins."""
        qweight = pack_values(q, bits)
        if not isinstance(group_size, int) or group_size <= 0 or q.shape[1] % group_size:
            raise ValueError(f"group_size ({group_size!r}) must divide in_features "
                             f"({q.shape[1]})")
        return cls(qweight, scales.to(torch.float32).contiguous(),
                   mins.to(torch.float32).contiguous(), group_size, bits, q.shape[1],
                   q.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.mins, self.group_size, self.bits)

    def use_int8_activations(self) -> bool:
        """From now on multiply through 8-bit activations (``int8_activations``) where the
        groups allow it (a multiple of 32 features); returns whether they do."""
        self.int8_activations = self.group_size % INT8_BLOCK == 0
        return self.int8_activations

    def stack_form(self) -> StackLinear:
        """This weight for the CPU LayerStack: ``heron_cpu::quant_linear`` (or its 8-bit
        activation form) on its tensors."""
        kind = StackLinear.GROUPED_INT8 if self.int8_activations else StackLinear.GROUPED
        return StackLinear(kind, self.qweight, self.scales, self.mins, self.group_size,
                           self.bits)

    def narrow_rows(self, start: int, length: int) -> GroupedIntWeight:
        """Output features start .. start + length (a tensor-parallel column shard)."""
        if start < 0 or length < 0 or start + length > self.out_features:
            raise ValueError(f"rows {start} .. {start + length} are outside 0 .. "
                             f"{self.out_features}")

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.narrow(0, start, length).contiguous()

        return GroupedIntWeight(rows(self.qweight), rows(self.scales), rows(self.mins),
                                self.group_size, self.bits, self.in_features, length,
                                self.int8_activations)


@functools.cache
def _triton_ready() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _kernel_ready() -> bool:
    from heron.kernels import cpu

    return cpu.load() and hasattr(torch.ops.heron_cpu, "quant_linear")


def quant_linear(x: torch.Tensor, w: GroupedIntWeight) -> torch.Tensor:
    """x (..., in_features) -> float32 (..., out_features) = x @ w.dequantize().T, accumulated
    in float32. On CPU through heron's C++ kernel when it builds (x converted to float32); on
    CUDA through the Triton dequant-GEMM (``heron.kernels.grouped_int_gemm``, x in its own
    dtype); otherwise dequantizing a tile of output features at a time."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {w.in_features}")
    lead = x.shape[:-1]
    if x.is_cuda and w.qweight.is_cuda and _triton_ready():
        from heron.kernels.grouped_int_gemm import grouped_int_gemm

        y = grouped_int_gemm(x.reshape(-1, w.in_features), w.qweight, w.scales, w.mins,
                             w.group_size, w.bits)
        return y.reshape(*lead, w.out_features)
    x2 = x.reshape(-1, w.in_features).to(torch.float32)
    if x2.device.type == "cpu" and w.qweight.device.type == "cpu" and _kernel_ready():
        op = torch.ops.heron_cpu.quant_linear_int8 if w.int8_activations else \
            torch.ops.heron_cpu.quant_linear
        y = op(x2, w.qweight, w.scales, w.mins, w.group_size, w.bits)
    else:
        y = _quant_linear_torch(x2, w)
    return y.reshape(*lead, w.out_features)


def _quant_linear_torch(x: torch.Tensor, w: GroupedIntWeight) -> torch.Tensor:
    y = x.new_empty(x.shape[0], w.out_features)
    tile = max(1, _FALLBACK_TILE_FLOATS // max(1, w.in_features))
    for n0 in range(0, w.out_features, tile):
        rows = min(tile, w.out_features - n0)
        y[:, n0:n0 + rows] = x @ w.narrow_rows(n0, rows).dequantize().T
    return y
