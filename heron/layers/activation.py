"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2 * d) -> (..., d): silu(gate) * up, gate first as in the fused gate_up weight."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
