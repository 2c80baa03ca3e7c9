"""A checkpoint tensor not read yet: safetensors reads only the slice a rank asks for.

``LazyTensor`` wraps a safetensors slice handle with the part of ``torch.Tensor`` that weight
loaders use (``shape``, ``dtype``, ``narrow``); ``materialize()`` reads it. Layer loaders
narrow lazy and plain tensors alike and read a lazy one only when they copy it
(``layers.linear.default_weight_loader``), so a tensor-parallel rank reads its shard of each
projection from the memory map and nothing else.
"""

from __future__ import annotations

import torch

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class ReadCounter:
    """Bytes read from checkpoint files (what sharded loading saves is visible here)."""

    def __init__(self) -> None:
        self.bytes_read = 0


class LazyTensor:
    """A (possibly narrowed) view of one checkpoint tensor, read on ``materialize``."""

    def __init__(self, handle, counter: ReadCounter | None = None,
                 ranges: tuple[tuple[int, int], ...] | None = None) -> None:
        self._handle = handle  # safetensors PySafeSlice
        self._counter = counter
        full = tuple(handle.get_shape())
        self._ranges = ranges or tuple((0, n) for n in full)
        self.dtype = _SAFETENSORS_DTYPES.get(handle.get_dtype(), None)
        if self.dtype is None:
            raise ValueError(f"unsupported safetensors dtype {handle.get_dtype()}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size(end - start for start, end in self._ranges)

    def dim(self) -> int:
        return len(self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim %= len(self._ranges)
        lo, hi = self._ranges[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape "
                             f"{tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = (lo + start, lo + start + length)
        return LazyTensor(self._handle, self._counter, tuple(ranges))

    def materialize(self) -> torch.Tensor:
        if not self._ranges:  # a scalar
            t = self._handle[...]
        else:
            t = self._handle[tuple(slice(lo, hi) for lo, hi in self._ranges)]
        if self._counter is not None:
            self._counter.bytes_read += t.numel() * t.element_size()
        return t

