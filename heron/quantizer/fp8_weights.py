"""FP8 weights (float8_e4m3fn) with per-output-channel or per-tensor scales, no calibration
(llm-compressor's FP8_DYNAMIC scheme: activations are quantized per token at run time)."""

from __future__ import annotations

import torch

from heron.quantizer.intgrid import ScaledQuant, round_scale

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCHEMES = ("per-channel", "per-tensor")


def fp8_quantize(weight: torch.Tensor, scheme: str = "per-channel",
                 scale_dtype: torch.dtype = torch.float32) -> ScaledQuant:
    """scale = max|w| / 448 per row (``per-channel``, (N, 1)) or over the tensor
    (``per-tensor``, (1,)); q = w / scale cast to float8_e4m3fn (round to nearest)."""
    w = weight.detach().to(torch.float32)
    if scheme == "per-channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    elif scheme == "per-tensor":
        amax = w.abs().amax().reshape(1)
    else:
        raise ValueError(f"--fp8-scheme must be one of {SCHEMES}, got {scheme!r}")
    scale = round_scale(amax / FP8_MAX, scale_dtype)
    q = torch.clamp(w / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return ScaledQuant(q, scale, scale_dtype)
