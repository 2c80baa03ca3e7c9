"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.layers.dispatch import cpu_ops_enabled, custom_kernel, triton_ops_enabled


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2 * d) -> (..., d): silu(gate) * up, gate first as in the fused gate_up weight;
    a plugin op selected for the slot ``activation:silu_and_mul`` replaces it."""
    kernel = custom_kernel("activation:silu_and_mul")
    if kernel is not None:
        return kernel(gate_up)
    if triton_ops_enabled():
        from heron.kernels.activation import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate_up)
    if cpu_ops_enabled(gate_up) and gate_up.dim() == 2:
        return torch.ops.heron_cpu.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2 * d) -> (..., d): gelu(gate, tanh approximation) * up (Gemma's
    ``gelu_pytorch_tanh``), gate first as in the fused gate_up weight."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
