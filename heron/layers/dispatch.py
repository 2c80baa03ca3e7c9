"""Which implementation the fused ops (RMSNorm, rotary, SiLU-and-mul) use: torch, Triton, or
heron's C++ CPU kernels.

The runner switches the Triton kernels on together with the triton attention backend, through
the step's forward context; outside a forward (unit tests, direct calls) torch runs. On CPU,
float32 tensors without autograd take ``torch.ops.heron_cpu``'s one-call versions where that
library builds (``heron.kernels.cpu``), except while dynamo traces
(``heron.worker.compiled_forward``), where inductor fuses the torch formulas itself. The kernel modules are imported only when used, so
heron runs where triton (or a compiler) is absent.
"""

from __future__ import annotations

import torch

from heron.attention.metadata import current_forward_context


def triton_ops_enabled() -> bool:
    ctx = current_forward_context()
    return ctx is not None and ctx.use_triton_ops


_cpu_kernels_built: bool | None = None  # heron.kernels.cpu.load(), asked once (it is per-step hot)


def cpu_ops_enabled(x: torch.Tensor) -> bool:
    """True where ``x`` can go through ``torch.ops.heron_cpu``'s small ops: CPU float32 with
    autograd off (they have no backward; the runner's steps run in inference mode, training an
    EAGLE head keeps the torch formulas)."""
    global _cpu_kernels_built
    if not x.is_cpu or x.dtype != torch.float32 or torch.is_grad_enabled() or \
            torch.compiler.is_compiling():
        return False
    if _cpu_kernels_built is None:
        from heron.kernels import cpu

        _cpu_kernels_built = cpu.load()
    return _cpu_kernels_built
