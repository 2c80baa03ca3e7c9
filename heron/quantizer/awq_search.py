"""AWQ (Lin et al., 2023): activation-aware per-input-channel scales before 4-bit rounding.

For linears that share one input X (q/k/v; gate/up) the weights are multiplied column-wise
by s = mean|X_j|^alpha (normalised to a geometric mean of about 1) and the inputs divided
by s, which leaves X W^T unchanged in exact arithmetic but gives the salient input channels
(large mean |x|) finer steps on the weight grid. alpha is picked from a grid over [0, 1) by
the output MSE of the fake-quantized layers on calibration rows; the division of X is folded
into the op that produces it (an RMSNorm's weight, or the rows of the previous linear).
Weights are then rounded asymmetrically, group-wise (``intgrid.awq_grid``).

Not done here: AutoAWQ's weight clipping search (``auto_clip``) after scaling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from heron.quantizer.gptq_solver import HessianAccumulator
from heron.quantizer.intgrid import rtn_quantize


class InputStats(HessianAccumulator):
    """Per-channel mean |x| and the second moment X^T X / n (half GPTQ's running H) over
    every row seen. The search's output error mean((X D^T)^2) (D = Wq - W) is
    sum((D @ XtX) * D) / N: exact over all calibration rows, at the cost of one K x K matrix."""

    def __init__(self, in_features: int):
        super().__init__(in_features)
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.abs_sum += x.abs().sum(dim=0, dtype=torch.float64)
        super().add(x)

    @property
    def xtx(self) -> torch.Tensor:
        return self.H / 2

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(1, self.n)).to(torch.float32)


@dataclass
class ScaleSearch:
    scales: torch.Tensor  # (K,) the chosen per-input-channel scales
    alpha: float
    losses: dict[float, float] = field(default_factory=dict)  # alpha -> output MSE


def fake_quant(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    return rtn_quantize(w, bits, group_size, sym=False, grid="awq").dequantize()


def search_scales(xtx: torch.Tensor, mean_abs: torch.Tensor, weights: list[torch.Tensor],
                  bits: int = 4, group_size: int = 128, n_grid: int = 20) -> ScaleSearch:
    """The alpha in {0, 1/n_grid, ..., (n_grid-1)/n_grid} whose scales minimise the output
    MSE of the fake-quantized, concatenated ``weights`` (N, K):
    sum((D @ xtx) * D) / N with D = Q(W diag s) diag s^-1 - W and xtx = X^T X / rows."""
    W = torch.cat([w.detach().to(torch.float32) for w in weights], dim=0)
    xtx = xtx.to(torch.float32)
    best = None
    losses = {}
    for i in range(n_grid):
        alpha = i / n_grid
        s = mean_abs.clamp(min=1e-4).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        D = fake_quant(W * s, bits, group_size) / s - W
        loss = float(((D @ xtx) * D).sum()) / W.shape[0]
        losses[alpha] = loss
        if best is None or loss < best[0]:
            best = (loss, alpha, s)
    return ScaleSearch(best[2], best[1], losses)


def _check_norm(norm: nn.Module) -> None:
    if "gemma" in type(norm).__name__.lower():
        raise ValueError("AWQ / SmoothQuant folding assumes x * weight norms, not Gemma's")


@torch.no_grad()
def fold_into_norm(norm: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """norm(x) / s feeds ``linears`` whose columns are multiplied by s: same function."""
    _check_norm(norm)
    norm.weight.div_(s.to(norm.weight.dtype))
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight.dtype))


@torch.no_grad()
def fold_into_linear(prev: nn.Linear, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """The rows (and bias) of ``prev`` divided by s, the columns of ``linears`` multiplied
    by s: exact when what lies between them is linear per channel (attention's mix of v,
    or the gate's product with up)."""
    prev.weight.div_(s.to(prev.weight.dtype)[:, None])
    if prev.bias is not None:
        prev.bias.div_(s.to(prev.bias.dtype))
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight.dtype))
