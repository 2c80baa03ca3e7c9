"""heron's own ops in the registry, declared as a plugin would declare them: the C++ CPU small
ops (``torch.ops.heron_cpu``, float32, built by ``heron.kernels.cpu``) for the activation and
norm slots, so ``heron check-kernels`` and ``heron bench kernels`` treat them as any other."""

from __future__ import annotations

import torch

from heron.kernels import reference
from heron.kernels.plugins.spec import OpSpec


def _cpu_built() -> bool:
    from heron.kernels import cpu

    return cpu.load()


def _randn(*shape: int, seed: int, device: str, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device)


def activation_cases(device: str):
    """(gate_up,) float32 cases: ragged widths, one row, values past +-7 (scaled by 4)."""
    for i, (rows, d) in enumerate([(3, 1100), (4, 300), (1, 64), (33, 576)]):
        yield (_randn(rows, 2 * d, seed=i, device=device, scale=4.0),)


def norm_cases(device: str):
    """(x, weight, eps, residual) float32 cases, without and with the residual add."""
    for i, (rows, hidden) in enumerate([(6, 200), (4, 1024), (1, 576)]):
        x = _randn(rows, hidden, seed=i, device=device)
        w = _randn(hidden, seed=10 + i, device=device)
        yield x, w, 1e-6, None
        yield x, w, 1e-5, _randn(rows, hidden, seed=20 + i, device=device)


def _cpu_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.heron_cpu.silu_and_mul(gate_up)


def _cpu_rms_norm(x, weight, eps: float, residual=None):
    if residual is None:
        return torch.ops.heron_cpu.rms_norm(x, weight, eps)
    return torch.ops.heron_cpu.add_rms_norm(x, residual, weight, eps)


def builtin_ops() -> list[OpSpec]:
    return [
        OpSpec("heron_cpu.silu_and_mul", "activation:silu_and_mul", _cpu_silu_and_mul,
               reference.silu_and_mul, activation_cases, backend="cpp", available=_cpu_built,
               description="heron's C++ SiLU-and-mul (the CPU float32 default)"),
        OpSpec("heron_cpu.rms_norm", "norm:rms_norm", _cpu_rms_norm, reference.rms_norm,
               norm_cases, backend="cpp", available=_cpu_built,
               description="heron's C++ RMSNorm, residual add fused (the CPU float32 default)"),
    ]
