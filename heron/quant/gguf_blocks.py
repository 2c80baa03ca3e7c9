"""GGUF's quantized blocks decoded into heron's grouped integer form (``int_layout``),
without going through float32: the values, and one scale and one min per group, such that
``q * scale + min`` is exactly what ``gguf.quants.dequantize`` computes.

Rows are the ggml tensor's rows (output features), each a run of blocks as llama.cpp writes
them (little-endian). Per type (QK = values per block):

* Q8_0 (QK 32): fp16 d, 32 int8            -> w = d * v                 (v + 128 stored)
* Q4_0 (QK 32): fp16 d, 16 bytes of nibbles -> w = d * (q - 8)
* Q4_1 (QK 32): fp16 d, fp16 m, nibbles    -> w = d * q + m
* Q5_0 (QK 32): fp16 d, 4 bytes of fifth bits (bit j: value j), nibbles -> w = d * (q - 16)
* Q5_1 (QK 32): fp16 d, fp16 m, fifth bits, nibbles                     -> w = d * q + m
* Q4_K (QK 256): fp16 d, dmin, 12 bytes of 6-bit (scale, min) for 8 groups of 32, 128 bytes
  of nibbles                                -> w = d * sc * q - dmin * mn
* Q5_K (QK 256): Q4_K plus 32 bytes holding each value's fifth bit
* Q6_K (QK 256): 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (groups of 16),
  fp16 d                                    -> w = d * sc * (q - 32)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

try:  # HF directories load without the gguf package; only decoding needs it
    from gguf import GGMLQuantizationType as T
except ImportError:  # pragma: no cover - exercised by the offline-dependencies test
    T = None


@dataclass
class DecodedRows:
    """q (rows, K) uint8 in [0, 2**bits); scales and mins float32 (rows, K // group_size)."""

    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    group_size: int
    bits: int


def _f16(raw: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) float32 of the little-endian fp16 they hold."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = data.reshape(data.shape[0], -1)
    return rows.reshape(rows.shape[0], -1, block_bytes)  # (rows, blocks, bytes)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32): low nibbles are values 0..15, high ones 16..31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _q8_0(data):
    b = _blocks(data, 34)
    d = _f16(b[..., 0:2])  # (rows, blocks)
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return DecodedRows(q.reshape(q.shape[0], -1), d, -128.0 * d, 32, 8)


def _q4_0(data):
    b = _blocks(data, 18)
    d = _f16(b[..., 0:2])
    q = _nibbles_32(b[..., 2:])
    return DecodedRows(q.reshape(q.shape[0], -1), d, -8.0 * d, 32, 4)


def _q4_1(data):
    b = _blocks(data, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _nibbles_32(b[..., 4:])
    return DecodedRows(q.reshape(q.shape[0], -1), d, m, 32, 4)


def _fifth_bits_32(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """(..., 4) bytes of high bits (a little-endian uint32, bit j for value j) and (..., 16)
    bytes of nibbles -> (..., 32) five-bit values."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return _nibbles_32(qs) | (bits << 4)


def _q5_0(data):
    b = _blocks(data, 22)
    d = _f16(b[..., 0:2])
    q = _fifth_bits_32(b[..., 2:6], b[..., 6:])
    return DecodedRows(q.reshape(q.shape[0], -1), d, -16.0 * d, 32, 5)


def _q5_1(data):
    b = _blocks(data, 24)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _fifth_bits_32(b[..., 4:8], b[..., 8:])
    return DecodedRows(q.reshape(q.shape[0], -1), d, m, 32, 5)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4)."""
    p = packed.astype(np.uint8)
    sc = np.empty(p.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = p[..., 0:4] & 63
    mn[..., :4] = p[..., 4:8] & 63
    sc[..., 4:] = (p[..., 8:12] & 0xF) | ((p[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_groups(d, dmin, sc, mn):
    """Per 32-value group: scale d * sc and min -dmin * mn, flattened over the row."""
    scales = d[..., None] * sc
    mins = -(dmin[..., None] * mn)
    return scales.reshape(scales.shape[0], -1), mins.reshape(mins.shape[0], -1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 128) bytes -> (..., 256): each 32-byte run gives 32 low then 32 high nibbles."""
    runs = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([runs & 0xF, runs >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _q4_k(data):
    b = _blocks(data, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    q = _k_nibbles(b[..., 16:144])
    scales, mins = _k_groups(d, dmin, sc, mn)
    return DecodedRows(q.reshape(q.shape[0], -1), scales, mins, 32, 4)


def _q5_k(data):
    b = _blocks(data, 176)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]  # bit 2j of qh[l]: value 64j + l; bit 2j + 1: value 64j + 32 + l
    low = _k_nibbles(b[..., 48:176]).reshape(*b.shape[:-1], 4, 2, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
    high = ((qh[..., None, None, :] >> shifts) & 1) << 4
    q = (low | high).reshape(*b.shape[:-1], 256).astype(np.uint8)
    scales, mins = _k_groups(d, dmin, sc, mn)
    return DecodedRows(q.reshape(q.shape[0], -1), scales, mins, 32, 5)


def _q6_k(data):
    b = _blocks(data, 210)
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # (rows, blocks, 16)
    d = _f16(b[..., 208:210])
    # Two halves of 128 values; in half n, value 32i + l (i = 0..3, l = 0..31) takes the low
    # or high nibble of ql[64n + l + 32 (i % 2)] and bits 2i of qh[32n + l].
    ql = ql.reshape(*b.shape[:-1], 2, 2, 32)  # (.., half, which 32 bytes, l)
    low = np.stack([ql[..., 0, :] & 0xF, ql[..., 1, :] & 0xF, ql[..., 0, :] >> 4,
                    ql[..., 1, :] >> 4], axis=-2)  # (.., half, i, l)
    qh = qh.reshape(*b.shape[:-1], 2, 1, 32)
    high = ((qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3) << 4
    q = (low | high).reshape(*b.shape[:-1], 256).astype(np.uint8)
    scales = (d[..., None] * sc).reshape(b.shape[0], -1)
    return DecodedRows(q.reshape(q.shape[0], -1), scales, -32.0 * scales, 16, 6)


DECODERS = {} if T is None else {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1,
                                 T.Q5_0: _q5_0, T.Q5_1: _q5_1,
                                 T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


def can_keep_quantized(tensor_type) -> bool:
    return tensor_type in DECODERS


def decode(data: np.ndarray, tensor_type) -> DecodedRows:
    """A ggml tensor's raw blocks (rows, bytes per row) -> its grouped integer form."""
    try:
        decoder = DECODERS[T(tensor_type)]
    except KeyError:
        raise ValueError(f"GGUF type {T(tensor_type).name} is not kept quantized; supported: "
                         f"{', '.join(t.name for t in DECODERS)}") from None
    return decoder(np.asarray(data))


def to_torch(rows: DecodedRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(np.ascontiguousarray(rows.q)),
            torch.from_numpy(np.ascontiguousarray(rows.scales, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(rows.mins, dtype=np.float32)))


class QuantizedRows:
    """A GGUF tensor decoded but not dequantized, as the loader hands it to a layer: q
    (N, K) uint8 values, scales and mins (N, K // group_size). ``narrow`` takes a
    tensor-parallel slice (rows, or whole groups of columns) like a tensor's."""

    dtype = torch.uint8

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 group_size: int, bits: int) -> None:
        self.q, self.scales, self.mins = q, scales, mins
        self.group_size, self.bits = group_size, bits

    @classmethod
    def from_raw(cls, data: np.ndarray, tensor_type) -> QuantizedRows:
        rows = decode(data, tensor_type)
        return cls(*to_torch(rows), rows.group_size, rows.bits)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def narrow(self, dim: int, start: int, length: int) -> QuantizedRows:
        if dim == 0:
            return QuantizedRows(self.q.narrow(0, start, length),
                                 self.scales.narrow(0, start, length),
                                 self.mins.narrow(0, start, length), self.group_size, self.bits)
        g = self.group_size
        if start % g or length % g:
            raise ValueError(f"a shard of {length} input features at {start} splits GGUF "
                             f"groups of {g}")
        return QuantizedRows(self.q.narrow(1, start, length),
                             self.scales.narrow(1, start // g, length // g),
                             self.mins.narrow(1, start // g, length // g), g, self.bits)

    def permute_rows(self, fn) -> QuantizedRows:
        """The same row permutation (e.g. undoing llama.cpp's q/k layout) on every part."""
        return QuantizedRows(fn(self.q), fn(self.scales), fn(self.mins), self.group_size,
                             self.bits)

    def regroup(self, group_size: int) -> QuantizedRows:
        """Split each group into groups of ``group_size`` (a divisor): same values."""
        repeat = self.group_size // group_size
        return QuantizedRows(self.q, self.scales.repeat_interleave(repeat, dim=1),
                             self.mins.repeat_interleave(repeat, dim=1), group_size, self.bits)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.to(torch.float32).reshape(n, -1, self.group_size)
        return (q * self.scales[..., None] + self.mins[..., None]).reshape(n, k)
