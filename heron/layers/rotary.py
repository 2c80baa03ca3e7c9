"""Rotary position embedding (HF "rotate_half" layout) with HF's rope scaling types
(``heron.layers.rope_scaling``: default, linear, dynamic, yarn, longrope, llama3)."""

from __future__ import annotations

import torch
from torch import nn

from heron.attention.metadata import current_forward_context
from heron.layers.dispatch import cpu_ops_enabled, triton_ops_enabled
from heron.layers.rope_scaling import (LENGTH_DEPENDENT, attention_factor, check_scaling,
                                       compute_inv_freq, dynamic_inv_freq)

__all__ = ["RotaryEmbedding", "apply_rotary", "compute_inv_freq"]


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
    step, and fixed tables that a CUDA graph can capture. cos and sin carry the rope type's
    attention factor, as HF's do.

    Length-dependent types (``needs_seq_lengths``: dynamic NTK, longrope) rotate a token
    according to the length ``L`` of its sequence: the runner sets, per token,
    ``L = max(position + 1, prompt length)`` as ``AttentionMetadata.rope_lengths`` (HF's
    choice for a whole-prompt prefill then one token per step, whatever the chunking);
    without it ``L`` is the largest position of the call + 1 for every token (HF's rule).
    At ``L`` up to the original length the plain table applies; above it longrope reads its
    long-factor table and dynamic NTK computes cos/sin for the token's own frequencies.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.rope_type = check_scaling(scaling, head_dim)  # validate eagerly
        self.attention_factor = attention_factor(scaling)
        self.needs_seq_lengths = self.rope_type in LENGTH_DEPENDENT
        self.original_len = scaling["original_max_position_embeddings"] \
            if self.needs_seq_lengths else None
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._long: tuple[torch.Tensor, torch.Tensor] | None = None  # longrope's cos, sin
        self._reserved = False

    def _table(self, inv_freq: torch.Tensor, length: int, device: torch.device):
        with torch.device("cpu"):
            t = torch.arange(length, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (length, D)
        scale = self.attention_factor
        return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)

    def _build(self, length: int, device: torch.device) -> None:
        with torch.device("cpu"):
            inv_freq = compute_inv_freq(self.head_dim, self.theta, self.scaling)
        self._cos, self._sin = self._table(inv_freq, length, device)
        if self.rope_type == "longrope":
            with torch.device("cpu"):
                long = compute_inv_freq(self.head_dim, self.theta, self.scaling,
                                        self.original_len + 1)
            self._long = self._table(long, length, device)

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
        cos, sin = self._cos[positions], self._sin[positions]  # (T, D) float32
        if self.needs_seq_lengths and positions.numel():
            cos, sin = self._length_dependent(positions, cos, sin)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def _seq_lengths(self, positions: torch.Tensor) -> torch.Tensor:
        """(T,) int64: the sequence length ``L`` each token is rotated for."""
        ctx = current_forward_context()
        lengths = getattr(ctx.attn_metadata, "rope_lengths", None) if ctx is not None else None
        if lengths is not None and lengths.shape == positions.shape:
            return lengths.to(positions.device)
        return (positions.max() + 1).expand(positions.shape)  # no host read

    def _length_dependent(self, positions, cos, sin):
        """cos/sin (T, D) of the tokens whose ``L`` exceeds the original length replaced."""
        lengths = self._seq_lengths(positions)
        over = (lengths > self.original_len).unsqueeze(1)  # (T, 1)
        if self.rope_type == "longrope":
            long_cos, long_sin = self._long
            return (torch.where(over, long_cos[positions], cos),
                    torch.where(over, long_sin[positions], sin))
        # dynamic NTK: each token's own frequencies (T x D/2, cheap), selected where L > original
        inv_freq = dynamic_inv_freq(self.head_dim, self.theta, self.scaling,
                                    lengths)  # (T, D/2)
        freqs = positions.float().unsqueeze(1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return torch.where(over, emb.cos(), cos), torch.where(over, emb.sin(), sin)


def sink_rope(rotary: RotaryEmbedding, dtype: torch.dtype):
    """cos, sin at each query's StreamingLLM cache position (``AttentionMetadata.
    sink_positions``) for the step being run; None in steps without StreamingLLM requests."""
    ctx = current_forward_context()
    md = ctx.attn_metadata if ctx is not None else None
    if md is None or md.sink_positions is None:
        return None
    return rotary(md.sink_positions, dtype)
