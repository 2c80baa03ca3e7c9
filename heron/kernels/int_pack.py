"""heron's grouped integer weight layout: packing and unpacking its values, and the float
reference dequantization (no other heron import: kernels, their checks and ``heron.quant``
all use it).

A linear layer with ``out_features`` N and ``in_features`` K holds unsigned values
``q[n, k]`` in ``[0, 2**bits)`` (``bits`` in 2..8) and, per row and group of ``group_size``
consecutive k, a float32 scale and offset (``scales``, ``mins``: (N, K // group_size)):

    w[n, k] = q[n, k] * scales[n, k // group_size] + mins[n, k // group_size]

(an integer zero point z becomes ``mins = -z * scales``). K and ``group_size`` are multiples
of 8 and ``group_size`` divides K (``group_size == K``: one group per row).

``qweight`` stores q as uint8. For ``bits <= 4`` it is (N, ceil(K / 64) * 32): chunks of 64
consecutive k in 32 bytes, read as 8 little-endian 32-bit words, where word j holds
``q[64c + 8i + j]`` in bits 4i .. 4i + 3 (byte 4j + b: value 16b + j in its low nibble,
16b + 8 + j in its high one; values past K are 0). One 32-byte load then yields a chunk's 8
runs of 8 values, run i as the load shifted right by 4i and masked with 0xF: one shift and one
AND per 8 values in the CPU kernel. For 5..8 bits it is (N, K), one value a byte.
"""

from __future__ import annotations

import torch

MIN_BITS, MAX_BITS = 2, 8
NIBBLE_MAX_BITS = 4  # up to this width two values share a byte
_RUN = 8  # values per run: in features and group sizes are multiples of it
_CHUNK = 64  # values per nibble chunk (32 bytes: 8 words of 8 nibbles)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer in {MIN_BITS}..{MAX_BITS}, got {bits!r}")


def packed_width(bits: int, k: int) -> int:
    """qweight's second dimension for ``k`` in features of ``bits``-bit values."""
    _check_bits(bits)
    return -(-k // _CHUNK) * (_CHUNK // 2) if bits <= NIBBLE_MAX_BITS else k


def pack_values(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q: integers (N, K) in [0, 2**bits), K a multiple of 8 -> qweight uint8
    (N, packed_width(bits, K)) (see the module docstring)."""
    _check_bits(bits)
    if q.dim() != 2:
        raise ValueError(f"values must be 2-D (out_features, in_features), got shape "
                         f"{tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype.is_complex or q.dtype == torch.bool:
        raise ValueError(f"values must be an integer tensor, got {q.dtype}")
    n, k = q.shape
    if k % _RUN:
        raise ValueError(f"in_features ({k}) must be a multiple of {_RUN}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise ValueError(f"values must lie in [0, {1 << bits}) for {bits}-bit weights, got "
                         f"[{int(q.min())}, {int(q.max())}]")
    v = q.to(torch.uint8)
    if bits > NIBBLE_MAX_BITS:
        return v.contiguous()
    chunks = -(-k // _CHUNK)
    v = torch.nn.functional.pad(v, (0, chunks * _CHUNK - k))
    v = v.reshape(n, chunks, _RUN // 2, 2, _RUN)  # (chunk, byte b, low / high nibble, word j)
    return (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).transpose(2, 3).reshape(n, chunks * 32) \
        .contiguous()


def unpack_values(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The inverse of ``pack_values``: qweight -> uint8 values (N, k)."""
    _check_bits(bits)
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D uint8 tensor, got {qweight.dtype} of shape "
                         f"{tuple(qweight.shape)}")
    if k % _RUN:
        raise ValueError(f"in_features ({k}) must be a multiple of {_RUN}")
    n = qweight.shape[0]
    if qweight.shape[1] != packed_width(bits, k):
        raise ValueError(f"qweight of {bits}-bit values for in_features {k} must be "
                         f"({n}, {packed_width(bits, k)}), got {tuple(qweight.shape)}")
    if bits > NIBBLE_MAX_BITS:
        return qweight.contiguous()
    b = qweight.reshape(n, -1, _RUN, 1, _RUN // 2).transpose(2, 4)  # (chunk, b, 1, j)
    return torch.cat([b & 0xF, b >> 4], dim=3).reshape(n, -1)[:, :k]


def check_groups(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                  group_size: int, bits: int) -> int:
    """Validates the grouped layout; returns in_features."""
    _check_bits(bits)
    if scales.dim() != 2 or mins.shape != scales.shape:
        raise ValueError(f"scales and mins must both be (out_features, groups), got "
                         f"{tuple(scales.shape)} and {tuple(mins.shape)}")
    if scales.dtype != torch.float32 or mins.dtype != torch.float32:
        raise ValueError(f"scales and mins must be float32, got {scales.dtype} and {mins.dtype}")
    if not isinstance(group_size, int) or group_size <= 0 or group_size % _RUN:
        raise ValueError(f"group_size must be a positive multiple of {_RUN}, got {group_size!r}")
    k = scales.shape[1] * group_size
    if qweight.dim() != 2 or qweight.shape[0] != scales.shape[0]:
        raise ValueError(f"qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} "
                         f"disagree on out_features")
    if qweight.dtype != torch.uint8 or qweight.shape[1] != packed_width(bits, k):
        raise ValueError(f"qweight of {bits}-bit values for in_features {k} must be uint8 "
                         f"({qweight.shape[0]}, {packed_width(bits, k)}), got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    return k


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               group_size: int, bits: int) -> torch.Tensor:
    """The reference: float32 weights (N, K), ``q * scale + min`` per group."""
    k = check_groups(qweight, scales, mins, group_size, bits)
    n, groups = scales.shape
    q = unpack_values(qweight, bits, k).to(torch.float32).reshape(n, groups, group_size)
    return (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).reshape(n, k)
