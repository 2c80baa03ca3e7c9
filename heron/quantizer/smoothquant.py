"""SmoothQuant (Xiao et al., 2022): move activation outliers into the weights, then int8.

Per input channel j of the linears fed by an RMSNorm, s_j = max|X_j|^alpha /
max|W_j|^(1 - alpha) (W: the siblings' weights side by side); the norm's weight is divided
by s and the linears' columns multiplied by it, which leaves the fp model's function as it
was while flattening the per-channel activation ranges that per-token int8 must cover. The
weights are then int8, symmetric, one scale per output channel (round to nearest); the
activations are quantized per token at run time by the loader (no stored scales).
"""

from __future__ import annotations

import torch

from heron.quantizer.intgrid import ScaledQuant, round_scale


class AbsMax:
    """Per-channel max |x| over every row seen."""

    def __init__(self, in_features: int):
        self.value = torch.zeros(in_features, dtype=torch.float32)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.value = torch.maximum(self.value, x.abs().amax(dim=0))


def smooth_scales(act_max: torch.Tensor, weights: list[torch.Tensor],
                  alpha: float = 0.5) -> torch.Tensor:
    """s (K,) = act_max^alpha / max|W[:, j]|^(1 - alpha); 1 where either side is 0."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must lie in [0, 1], got {alpha}")
    w_max = torch.stack([w.detach().abs().amax(dim=0).to(torch.float32) for w in weights])
    w_max = w_max.amax(dim=0)
    a = act_max.to(torch.float32)
    s = a.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1.0 - alpha)
    return torch.where((a > 0) & (w_max > 0), s, torch.ones_like(s))


def int8_channel_quantize(weight: torch.Tensor,
                          scale_dtype: torch.dtype = torch.float32) -> ScaledQuant:
    """Symmetric int8 per output channel: scale = max|w_row| / 127, q in [-127, 127]."""
    w = weight.detach().to(torch.float32)
    scale = round_scale(w.abs().amax(dim=1, keepdim=True) / 127.0, scale_dtype)
    q = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
    return ScaledQuant(q, scale, scale_dtype)
