"""Attention backends by name: ``torch`` (reference, any device), ``cpu`` (heron's C++ paged
attention kernel for decodes and prefill chunks, CPU), ``triton`` (CUDA; CPU only under the triton interpreter) and ``auto``
(triton on CUDA when installed; on CPU the C++ kernel when it builds, else torch). The ranks of
a context-parallel group attend through ``heron.attention.context_parallel`` instead."""

from __future__ import annotations

import logging

import torch

from heron.kernels.runtime import has_triton

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The concrete backend ``name`` selects on ``device``; raises ValueError if unknown."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; available: {list(BACKEND_NAMES)}")
    if name == "auto" and device.type == "cuda":
        return "triton" if has_triton() else "torch"
    if name == "auto":
        from heron.kernels import cpu

        return "cpu" if device.type == "cpu" and cpu.load() else "torch"
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on the CPU, not on {device}")
    return name


def get_attention_backend(name: str, device: torch.device | str = "cpu", cp_group=None):
    """An instance of the backend ``name`` resolves to on ``device``. The triton backend is
    imported only here, so heron runs where triton is absent. A context-parallel group of
    more than one rank (``cp_group``) gets ``ContextParallelAttention`` whatever the name."""
    device = torch.device(device)
    resolved = resolve_backend_name(name, device)
    if cp_group is not None and cp_group.world_size > 1:
        from heron.attention.context_parallel import ContextParallelAttention

        if name not in ("auto", "torch"):
            logger.info("context parallelism attends through its own torch path; "
                        "--attention-backend %s applies at context-parallel size 1", name)
        return ContextParallelAttention(cp_group)
    if resolved == "torch":
        from heron.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if resolved == "cpu":
        from heron.kernels import cpu

        if not cpu.load():
            raise RuntimeError("the cpu attention backend needs heron's C++ kernel, which did "
                               "not build here (see the warning above); use 'torch'")
        from heron.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    from heron.kernels.runtime import require_triton

    require_triton(device)  # a clear error before importing triton kernels
    from heron.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(device)
