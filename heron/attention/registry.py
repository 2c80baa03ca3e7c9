"""Attention backends by name: ``torch`` (reference, any device), ``triton`` (CUDA; CPU only
under the triton interpreter) and ``auto`` (triton on CUDA when installed, else torch)."""

from __future__ import annotations

import torch

from heron.kernels.runtime import has_triton

BACKEND_NAMES = ("auto", "torch", "triton")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The concrete backend ``name`` selects on ``device``; raises ValueError if unknown."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; available: {list(BACKEND_NAMES)}")
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton() else "torch"
    return name


def get_attention_backend(name: str, device: torch.device | str = "cpu"):
    """An instance of the backend ``name`` resolves to on ``device``. The triton backend is
    imported only here, so heron runs where triton is absent."""
    device = torch.device(device)
    resolved = resolve_backend_name(name, device)
    if resolved == "torch":
        from heron.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    from heron.kernels.runtime import require_triton

    require_triton(device)  # a clear error before importing triton kernels
    from heron.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(device)
