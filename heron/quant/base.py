"""The seam between a linear layer and how its weight is stored: a ``LinearMethod``.

A linear layer (``layers.linear``) owns the shapes and the tensor-parallel slice; its method
owns the rest: which parameters exist (``create_weights``: names as the checkpoint spells
them, dtypes as it stores them, never cast to the model dtype), what they become after
loading (``process_weights_after_loading``: repacked for heron's kernels) and the matmul
(``apply``). ``UnquantizedLinearMethod`` is one method among the others; on CPU the loader
swaps a float32 layer's for ``layers.cpu_gemm.CpuGemmMethod`` once its weight is loaded.

A vocabulary table (``layers.embedding``: the token embedding and the LM head) goes through
the same seam: its method is a ``LinearMethod`` whose ``apply`` is the LM head's matmul, plus
``embedding(layer, ids)``, the row lookup (``UnquantizedEmbeddingMethod``; a GGUF table kept
quantized uses ``methods.gguf.GGUFEmbeddingMethod``). The layer owns its float ``weight``.

Each parameter carries a ``ParamLayout``: which of its dimensions index the layer's output and
input features, and how many features one element there covers (a packing factor, or a
quantization group). The layer narrows checkpoint tensors to its shard through it, whatever
the format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ParamLayout:
    """How a parameter's dimensions map onto the layer's (out_features, in_features).

    ``output_dim`` / ``input_dim``: the dimension indexing output / input features (None: the
    parameter does not vary along them and is replicated on every rank). ``output_per_element``
    / ``input_per_element``: features per element along that dimension (8 for eight 4-bit
    values in an int32, the group size for group-wise scales). ``per_shard``: one entry per
    fused projection along dimension 0 (per-tensor scales of a fused qkv, GPTQ's g_idx); the
    checkpoint tensor is one entry, and ``input_dim`` counts the parameter's dimensions.
    """

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_per_element: int = 1
    input_per_element: int = 1
    per_shard: bool = False

    def output_slice(self, start: int, length: int) -> tuple[int, int]:
        """Logical output rows [start, start + length) -> this dimension's element range."""
        return _scaled(start, length, self.output_per_element, "output")

    def input_slice(self, start: int, length: int) -> tuple[int, int]:
        return _scaled(start, length, self.input_per_element, "input")


def _scaled(start: int, length: int, per: int, what: str) -> tuple[int, int]:
    if start % per or length % per:
        raise ValueError(f"a tensor-parallel shard of {length} {what} features at {start} does "
                         f"not align with the format's {per} features per element")
    return start // per, length // per


FULL = ParamLayout()  # a plain (out, in) weight
VECTOR = ParamLayout(output_dim=0, input_dim=None)  # bias, per-channel scale (out,) / (out, 1)


def add_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              layout: ParamLayout, optional: bool = False) -> nn.Parameter:
    """Register an uninitialised parameter with its layout (``optional``: the checkpoint may
    omit it, e.g. a GPTQ ``g_idx`` for sequential groups)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    layer.register_parameter(name, param)
    layer.param_layouts[name] = layout
    if optional:
        layer.optional_params.add(name)
    return param


@dataclass(frozen=True)
class StackLinear:
    """A projection as heron_cpu's LayerStack runs it (``heron/kernels/cpu/layer_stack.cpp``):
    the C++ call that gives the same bits as the method's ``apply``. ``kind``: GEMM (``a`` the
    column-major weight or None, ``b`` oneDNN's packed one), PLAIN (``a`` a float32 weight for
    ``aten::linear``) or GROUPED (``a, b, c`` = qweight, scales, mins of heron's grouped
    integer layout, ``heron_cpu::quant_linear``; the bias added after) or GROUPED_INT8 (the
    same tensors, ``heron_cpu::quant_linear_int8``: 8-bit activations)."""

    GEMM, PLAIN, GROUPED, GROUPED_INT8 = 0, 1, 2, 3

    kind: int
    a: torch.Tensor | None
    b: torch.Tensor | None = None
    c: torch.Tensor | None = None
    group_size: int = 0
    bits: int = 0

    @classmethod
    def plain(cls, weight: torch.Tensor) -> StackLinear | None:
        """A dense weight multiplied by ``F.linear``: PLAIN where it is float32, else None."""
        return cls(cls.PLAIN, weight) if weight.dtype == torch.float32 else None


class LinearMethod:
    """How one linear layer stores and multiplies its weight (see the module docstring).

    ``layer`` gives the method ``in_features`` / ``out_features`` (this rank's), and
    ``output_sizes`` (this rank's rows of each fused projection)."""

    name = "base"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack loaded checkpoint tensors into the form ``apply`` reads (default: as is)."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features)."""
        raise NotImplementedError

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes this layer's weight occupies as ``apply`` reads it (not the bias)."""
        return sum(p.numel() * p.element_size() for n, p in layer.named_parameters(
            recurse=False) if n != "bias")

    def describe(self) -> str:
        return self.name

    def stack_form(self, layer: nn.Module) -> StackLinear | None:
        """The layer's matmul as the CPU LayerStack runs it, or None where it has no C++
        form with the same bits (then the model runs its layers in Python)."""
        return None

    def use_int8_activations(self, layer: nn.Module) -> bool:
        """Switch the layer's CPU matmul to 8-bit activations and integer dot products
        (``--cpu-int8-dot``); False where the method has no such path (the default)."""
        return False


def use_int8_activations(model: nn.Module) -> int:
    """Every layer of ``model`` whose method can multiply through 8-bit activations does so
    from now on (not exact against the dequantized path); returns how many switched. A
    method shared by two layers (a tied LM head's) counts once."""
    switched = set()
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is not None and id(method) not in switched and \
                method.use_int8_activations(layer):
            switched.add(id(method))
    return len(switched)


class UnquantizedLinearMethod(LinearMethod):
    """A float weight (out, in) in the model dtype, multiplied by ``F.linear``."""

    name = "unquantized"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        add_param(layer, "weight", (layer.out_features, layer.in_features), dtype, FULL)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)

    def weight_bytes(self, layer) -> int:
        w = layer.weight
        return w.numel() * w.element_size()

    def stack_form(self, layer):
        return StackLinear.plain(layer.weight)


class UnquantizedEmbeddingMethod(UnquantizedLinearMethod):
    """A float vocabulary table ``weight`` (rows, hidden) in the model dtype (the layer creates
    it; ``create_weights`` is not called): rows gathered by token id; as an LM head,
    ``F.linear`` (hidden (N, hidden) -> (N, rows))."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) local row ids -> (T, hidden) rows of the table."""
        return F.embedding(ids, layer.weight)
