"""Which implementation the fused ops (RMSNorm, rotary, SiLU-and-mul) use: torch or Triton.

The runner switches the Triton kernels on together with the triton attention backend, through
the step's forward context; outside a forward (unit tests, direct calls) torch runs. The
kernel modules are imported only when used, so heron runs where triton is absent.
"""

from __future__ import annotations

from heron.attention.metadata import current_forward_context


def triton_ops_enabled() -> bool:
    ctx = current_forward_context()
    return ctx is not None and ctx.use_triton_ops
