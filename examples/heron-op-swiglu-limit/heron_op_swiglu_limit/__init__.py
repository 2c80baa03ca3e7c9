"""heron operator plugin ``swiglu_limit``: the MLP activation silu(gate) * up with the clamp
gpt-oss puts on its SwiGLU (``swiglu_limit`` = 7.0: gate <= 7, -7 <= up <= 7), as a C++ CPU
kernel (float32, OpenMP over rows) built on first use with torch's ``load_inline``.

It plugs into heron's ``activation:silu_and_mul`` slot; select it with
``--custom-ops swiglu_limit``. Registered through the ``heron.ops`` entry point (pyproject).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

LIMIT = 7.0  # gpt-oss's config.json "swiglu_limit"


@functools.cache
def _library():
    """The compiled extension (cached by torch under ~/.cache/torch_extensions)."""
    from torch.utils.cpp_extension import load_inline

    source = (Path(__file__).parent / "swiglu_limit.cpp").read_text()
    return load_inline(name="heron_op_swiglu_limit", cpp_sources=[source],
                       functions=["swiglu_limit"], extra_cflags=["-O3", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], verbose=False)


def swiglu_limit(gate_up: torch.Tensor, limit: float = LIMIT) -> torch.Tensor:
    """(..., 2 * d) float32 CPU -> (..., d): silu(min(gate, limit)) * clamp(up, +-limit)."""
    lead = gate_up.shape[:-1]
    out = _library().swiglu_limit(gate_up.reshape(-1, gate_up.shape[-1]), limit)
    return out.reshape(*lead, out.shape[-1])


def reference(gate_up: torch.Tensor, limit: float = LIMIT) -> torch.Tensor:
    """The same in float64 torch."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate) * up


def cases(device: str):
    """(gate_up,) float32: ragged widths, one row, SmolLM2's width (1536), values past +-7."""
    shapes = [(1, 64, 1.0), (3, 1100, 4.0), (4, 300, 10.0), (33, 1536, 4.0), (2, 7, 30.0)]
    for i, (rows, d, scale) in enumerate(shapes):
        gen = torch.Generator().manual_seed(i)
        yield ((torch.randn(rows, 2 * d, generator=gen) * scale).to(device),)
    yield (torch.tensor([[8.0, -20.0, 7.0, 1.0, 9.0, -9.0]], device=device),)  # at the limits


def op_specs():
    """The entry point: this package's ops (heron imports it only when discovering)."""
    from heron.kernels.plugins import OpSpec

    return [OpSpec("swiglu_limit", "activation:silu_and_mul", swiglu_limit, reference, cases,
                   backend="cpp", description="silu(gate)*up, gpt-oss's clamp at 7 (C++)")]
