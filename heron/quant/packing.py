"""Integer values packed into int32 words, as published checkpoints store them.

A word holds ``32 // bits`` consecutive values along one dimension; value ``order[i]`` of the
word's run sits at bits ``[i * bits, (i + 1) * bits)`` (``order`` is sequential for GPTQ and
compressed-tensors, ``AWQ_ORDER`` for AutoAWQ's GEMM layout). Values are unsigned here:
``[0, 2**bits)``; signed formats add their offset before packing.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i holds column order[i]
SUPPORTED_BITS = (2, 4, 8)  # the widths that fill a 32-bit word exactly


def _check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"packed int32 weights need bits in {SUPPORTED_BITS}, got {bits}")
    return 32 // bits


def pack_int32(values: torch.Tensor, bits: int, dim: int,
               order: tuple[int, ...] | None = None) -> torch.Tensor:
    """values: integers in [0, 2**bits), 2-D -> int32 with ``dim`` shrunk ``32 // bits``-fold
    (that dimension is zero-padded to a whole number of words)."""
    per_word = _check_bits(bits)
    order = order or tuple(range(per_word))
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"values must lie in [0, {1 << bits}) to pack as {bits}-bit")
    v = v.movedim(dim, -1)
    pad = (-v.shape[-1]) % per_word
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.reshape(*v.shape[:-1], -1, per_word)  # (..., words, per_word)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for slot, element in enumerate(order):
        word |= v[..., element] << (slot * bits)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)  # two's complement int32
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, size: int | None = None,
                 order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of ``pack_int32``: int32 words -> uint8 values, ``dim`` grown
    ``32 // bits``-fold and cut to ``size`` when given (padding dropped)."""
    per_word = _check_bits(bits)
    order = order or tuple(range(per_word))
    w = packed.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    mask = (1 << bits) - 1
    out = torch.empty(*w.shape, per_word, dtype=torch.uint8)
    for slot, element in enumerate(order):
        out[..., element] = ((w >> (slot * bits)) & mask).to(torch.uint8)
    out = out.reshape(*w.shape[:-1], -1)
    if size is not None:
        out = out[..., :size]
    return out.movedim(-1, dim).contiguous()
