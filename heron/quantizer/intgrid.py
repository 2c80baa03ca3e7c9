"""Integer weight grids shared by the quantizers: group-wise scale / zero-point choice and
round-to-nearest onto them, and ``IntQuant``, one linear's result in a format-neutral form.

Scales are rounded to their storage dtype (float16 for GPTQ and AWQ) *before* the weights
are rounded onto the grid, so the quantizer's dequantized weights are exactly what a loader
computes from the file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntQuant:
    """A (N, K) weight as unsigned ``bits``-bit integers on per-group grids.

    ``q``: (N, K) uint8 in [0, 2**bits); ``scales``: (G, N) float32 holding values exact in
    ``scale_dtype``; ``zeros``: (G, N) int64 in [0, 2**bits); ``g_idx``: (K,) int64, the group
    of each input column. w[n, k] = scales[g, n] * (q[n, k] - zeros[g, n]) with g = g_idx[k].
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int  # -1: one group over all columns
    sym: bool
    scale_dtype: torch.dtype = torch.float16

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = self.num_groups
        if k % g == 0 and torch.equal(self.g_idx, torch.arange(k) // (k // g)):
            s = self.scales.t()[:, :, None]  # sequential whole groups: no gather
            z = self.zeros.t()[:, :, None].to(torch.float32)
            q = self.q.reshape(n, g, k // g).to(torch.float32)
            return (s * (q - z)).reshape(n, k)
        s = self.scales[self.g_idx].t()  # (N, K)
        z = self.zeros[self.g_idx].t()
        return s * (self.q.to(torch.float32) - z.to(torch.float32))

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[0])


def round_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` as float32 values exactly representable in ``dtype``, never 0."""
    tiny = torch.finfo(dtype).smallest_normal if dtype.is_floating_point else 1e-12
    return scale.clamp(min=tiny).to(dtype).to(torch.float32)


def gptq_grid(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 1,
              scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's min-max grid per row of ``w`` (rows, cols): the range always contains 0;
    symmetric grids have zero 2**(bits-1) and scale 2*absmax/maxq. ``min_zero`` keeps an
    asymmetric zero point >= 1 (GPTQ v1 checkpoints store zero - 1 unsigned)."""
    maxq = 2 ** bits - 1
    w = w.to(torch.float32)
    xmin = w.amin(dim=1).clamp(max=0)
    xmax = w.amax(dim=1).clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(empty, torch.full_like(xmax, 1.0), xmax)
    scale = round_scale((xmax - xmin) / maxq, scale_dtype)
    if sym:
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        zero = torch.round(-xmin / scale).clamp(min_zero, maxq)
    return scale, zero.to(torch.int64)


def awq_grid(w: torch.Tensor, bits: int,
             scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's asymmetric grid per row: the row's own [min, max] over 2**bits - 1 steps."""
    maxq = 2 ** bits - 1
    w = w.to(torch.float32)
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    scale = round_scale((hi - lo).clamp(min=1e-5) / maxq, scale_dtype)
    zero = (-torch.round(lo / scale)).clamp(0, maxq)
    return scale, zero.to(torch.int64)


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  bits: int) -> torch.Tensor:
    """Integers of ``w`` (rows, cols) on per-row grids (scale, zero: (rows,)) -> int64."""
    maxq = 2 ** bits - 1
    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, maxq).to(torch.int64)


def dequant_grid(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale[:, None] * (q.to(torch.float32) - zero[:, None].to(torch.float32))


def num_groups(in_features: int, group_size: int) -> int:
    if group_size == -1:
        return 1
    if group_size <= 0:
        raise ValueError(f"group size must be positive or -1, got {group_size}")
    return -(-in_features // group_size)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = True,
                 grid: str = "gptq", scale_dtype: torch.dtype = torch.float16) -> IntQuant:
    """Round-to-nearest group-wise quantization of a (N, K) weight (sequential groups).
    ``grid``: ``gptq`` (range through 0, ``sym`` honoured) or ``awq`` (asymmetric min-max)."""
    w = w.detach().to(torch.float32)
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    groups = num_groups(k, group_size)
    g_idx = torch.arange(k) // gs
    fit = awq_grid if grid == "awq" else (
        lambda rows, b, dt: gptq_grid(rows, b, sym, scale_dtype=dt))
    if k % gs == 0:  # whole groups: every (row, group) is one row of a reshaped view
        rows = w.reshape(n * groups, gs)
        s, z = fit(rows, bits, scale_dtype)
        q = round_to_grid(rows, s, z, bits).reshape(n, k)
        return IntQuant(q.to(torch.uint8), s.reshape(n, groups).t().contiguous(),
                        z.reshape(n, groups).t().contiguous(), g_idx, bits, group_size,
                        sym and grid != "awq", scale_dtype)
    q = torch.empty(n, k, dtype=torch.int64)
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = slice(g * gs, min(k, (g + 1) * gs))
        s, z = fit(w[:, cols], bits, scale_dtype)
        q[:, cols] = round_to_grid(w[:, cols], s, z, bits)
        scales[g], zeros[g] = s, z
    return IntQuant(q.to(torch.uint8), scales, zeros, g_idx, bits, group_size,
                    sym and grid != "awq", scale_dtype)


@dataclass
class ScaledQuant:
    """A (N, K) weight as ``q`` (int8 or float8_e4m3fn, (N, K)) times ``scale`` ((N, 1) per
    output channel, or (1,) per tensor) holding float32 values exact in ``scale_dtype``:
    compressed-tensors' int-quantized / float-quantized symmetric weights."""

    q: torch.Tensor
    scale: torch.Tensor
    scale_dtype: torch.dtype = torch.float32

    def dequantize(self) -> torch.Tensor:
        return self.q.to(torch.float32) * self.scale
