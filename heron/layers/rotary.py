"""Rotary position embedding (HF "rotate_half" layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from heron.layers.dispatch import cpu_ops_enabled, triton_ops_enabled


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency smoothing: long wavelengths slowed by ``factor``, short ones kept,
    the band in between interpolated."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} "
                     f"(supported: default, linear, llama3)")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D), cos/sin: (T, 1, D) -> x rotated (HF "rotate_half" layout)."""
    if triton_ops_enabled():
        from heron.kernels.rotary import apply_rotary as apply_rotary_kernel

        return apply_rotary_kernel(x, cos, sin)
    if cpu_ops_enabled(x) and x.dim() == 3 and cos.dtype == torch.float32:
        t = x.shape[0]
        return torch.ops.heron_cpu.rotary(x, cos.reshape(t, -1), sin.reshape(t, -1))
    return x * cos + _rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE, looked up once per step and shared by every layer.

    Tables are built lazily on the first call's device (the module may be created on the
    meta device) and grown on demand, which reads the largest position on the host. A runner
    that knows its positions calls ``reserve`` instead: no host read (no device sync) per
    step, and fixed tables that a CUDA graph can capture.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        compute_inv_freq(head_dim, theta, scaling)  # validate eagerly
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._reserved = False

    def _build(self, length: int, device: torch.device) -> None:
        with torch.device("cpu"):
            inv_freq = compute_inv_freq(self.head_dim, self.theta, self.scaling)
            t = torch.arange(length, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (length, D)
        self._cos, self._sin = emb.cos().to(device), emb.sin().to(device)

    def reserve(self, length: int, device: torch.device) -> bool:
        """Cover positions < ``length`` on ``device`` from now on; the caller promises never to
        pass larger positions. Returns True when the tables were rebuilt (new tensors: a CUDA
        graph that captured the old ones must be dropped)."""
        self._reserved = True
        same_device = self._cos is not None and self._cos.device.type == torch.device(device).type
        current = self._cos.shape[0] if same_device else 0
        if current >= length:
            return False
        self._build(max(length, 2 * current), device)  # doubling: rebuilt O(log) times
        return True

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: (T,) -> cos, sin: (T, 1, D) in ``dtype``."""
        if not self._reserved:
            max_pos = int(positions.max()) if positions.numel() else 0
            if self._cos is None or self._cos.device != positions.device or \
                    max_pos >= self._cos.shape[0]:
                self._build(max(4096, 2 * (max_pos + 1)), positions.device)
        cos = self._cos[positions].unsqueeze(1).to(dtype)
        sin = self._sin[positions].unsqueeze(1).to(dtype)
        return cos, sin
