"""Whether Triton kernels can run here, and launch settings shared by every kernel.

Triton runs on CUDA tensors, or on CPU tensors under its interpreter (``TRITON_INTERPRET=1``,
read by triton when a kernel is defined, so it must be set before the kernel modules are
imported). heron reads it through ``heron.envs``; ``use_interpreter`` sets it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from heron import envs


@functools.cache
def has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a module entry without a spec
        return False


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter."""
    return envs.TRITON_INTERPRET


def triton_usable(device: torch.device) -> bool:
    """Triton kernels can run on tensors of ``device``."""
    if not has_triton():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def require_triton(device: torch.device) -> None:
    """Raise a clear error when triton kernels cannot run on ``device``."""
    if not has_triton():
        raise ValueError("the triton backend needs the `triton` package (pip install triton)")
    if not triton_usable(device):
        raise ValueError(f"triton kernels cannot run on {device.type} tensors; on CPU they run "
                         f"only under the interpreter (TRITON_INTERPRET=1, for tests)")


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Feed ``tl.dot`` float32 operands: always for float32 inputs (IEEE, not TF32), and for
    half types under the interpreter, whose bf16 dot is wrong."""
    return dtype == torch.float32 or interpreting()


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 8 elsewhere)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def use_interpreter() -> None:
    """Run Triton kernels in the CPU interpreter; only before any kernel module is imported."""
    import sys

    loaded = [m for m in sys.modules if m.startswith("heron.kernels.") and m.rsplit(".", 1)[1]
              in ("attention_prefill", "attention_decode", "kv_store", "rmsnorm", "rotary",
                  "activation")]
    if loaded and not interpreting():
        raise RuntimeError(f"triton kernels already defined for the GPU: {loaded}")
    os.environ["TRITON_INTERPRET"] = "1"
