"""CPU matmuls for float32 projection weights: a column-major weight for a few rows (GEMV),
oneDNN's prepacked (blocked) weight for more.

Measured on the 2-core EPYC this project runs on (SmolLM2-135M shapes, one thread, each
layer's weights cold in cache as in a real forward; benchmarks/cpu_gemm.py):

* 1 row: a column-major weight (a transposed view of a contiguous (in, out) buffer) streams
  ~1.3x faster than the row-major one and ~1.25x faster than the packed forms;
* 32-64 rows: the column-major weight is the slowest form; oneDNN's packed weight is ~1.3x
  (32 rows) to ~1.4x (64 rows) faster on the decoder's projections and ~2.7x on the
  49152-wide LM head. (MKL's packed sgemm, ``torch.ops.mkl._mkl_linear``, is as fast but
  only for the one row count it was packed for: other counts fall back to the plain weight.)

So every float32 projection keeps both copies (``dual``: twice the projection memory) and
picks per call by the number of rows; ``dual=False`` keeps only the packed copy (not used by
the loader yet). Where torch lacks oneDNN, ``loader.weights.optimize_layout`` keeps the
column-major weight alone and ``F.linear`` runs.

The layer reaches it through the method seam (``quant.base``): ``use_cpu_gemm`` swaps a float
layer's method (a linear layer's or the LM head's) for a ``CpuGemmMethod`` holding the
``CpuGemm``, and ``drop_cpu_gemm`` swaps the plain one back.

Batch invariance: the two forms round differently, so a row's result depends on how many
rows share the call (1-3 vs 4+: a last-bit difference, enough to flip a greedy near-tie).
oneDNN's packed form alone gives every row the same bits whatever the row count (checked by
tests/models/test_batch_invariance.py), at 1.1-1.5x the column-major time for one row. With
``BATCH_INVARIANT`` set (``set_batch_invariant``; vLLM's ``VLLM_BATCH_INVARIANT``) the
packed form runs for every row count. Quantized layers are batch invariant always
(``heron.kernels.cpu``'s quant_linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.quant.base import StackLinear, UnquantizedEmbeddingMethod, UnquantizedLinearMethod

GEMV_MAX_ROWS = 3  # up to this many rows the column-major copy is used
BATCH_INVARIANT = False  # True: the packed form for every row count (see the docstring)


def set_batch_invariant(enabled: bool) -> None:
    """Every float32 projection gives a row the same bits whatever else is in its batch."""
    global BATCH_INVARIANT
    BATCH_INVARIANT = bool(enabled)


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


class CpuGemm:
    """``y = x W^T (+ b)`` for one float32 weight W (out, in), in its fastest layouts."""

    def __init__(self, weight: torch.Tensor, dual: bool) -> None:
        w = weight.detach().contiguous()  # (out, in), row-major
        self.gemv = w.t().contiguous().t() if dual else None  # column-major view
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w)  # oneDNN's blocked layout

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: (rows, in) -> (rows, out)."""
        if self.gemv is not None and x.shape[0] <= GEMV_MAX_ROWS and not BATCH_INVARIANT:
            return F.linear(x, self.gemv, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class CpuGemmMethod(UnquantizedEmbeddingMethod):
    """A float32 weight multiplied through its ``CpuGemm`` (``gemm``); the layer's ``weight``
    is the column-major copy. Serves a linear layer or an LM head (and, the weight being
    plain, a table's lookups); ``plain`` is the method it replaced (``drop_cpu_gemm``)."""

    def __init__(self, gemm: CpuGemm, plain: UnquantizedLinearMethod) -> None:
        self.gemm, self.plain = gemm, plain

    def apply(self, layer, x, bias=None):
        return self.gemm(x, bias)

    def stack_form(self, layer):
        return StackLinear(StackLinear.GEMM, self.gemm.gemv, self.gemm.packed)


def use_cpu_gemm(layer: nn.Module) -> None:
    """Give a layer with a plain float method (``UnquantizedLinearMethod``) its CPU layouts:
    a float32 weight a ``CpuGemmMethod`` (both copies; ``weight`` becomes the column-major
    one) where oneDNN is there, else only the column-major weight for ``F.linear``."""
    weight = layer.weight.data
    if weight.dtype == torch.float32 and packing_available():
        gemm = CpuGemm(weight, dual=True)
        layer.quant_method = CpuGemmMethod(gemm, layer.quant_method)
        layer.weight.data = gemm.gemv
    else:
        layer.weight.data = weight.t().contiguous().t()


def drop_cpu_gemm(module: nn.Module) -> None:
    """Every layer under ``module`` back to its plain method (``F.linear`` on the column-major
    weight): for callers that pack the weights themselves (inductor's freezing) or that need
    autograd through the matmul."""
    for layer in module.modules():
        method = getattr(layer, "quant_method", None)
        if isinstance(method, CpuGemmMethod):
            layer.quant_method = method.plain
