"""A GGUF file's metadata and tensors, read lazily from a memory map.

The ``gguf`` package's ``GGUFReader`` builds a numpy view per element of every metadata
array up front: for a 262,144-token vocabulary (Gemma 3) that alone takes 20-40 s per
process. Here a metadata array is only stepped over when the file is opened (strings: one
length read each; numbers: skipped whole) and decoded when asked for. Tensors are the same
numpy views of the memory map as ``GGUFReader`` gives: ``data`` shaped like the tensor in
row-major order (ggml dims reversed), a quantized type as raw bytes with its last dim in
bytes. Little-endian GGUF v2 and v3 (what llama.cpp writes).

Layout: magic ``GGUF``, version u32, tensor count u64, metadata count u64; each metadata
entry a string key, a value type u32 and the value (an array: element type u32, count u64,
elements); each tensor info a string name, dim count u32, dims u64 (ggml order: fastest
first), type u32, offset u64 from the data section, which starts at the next multiple of
``general.alignment`` (32 by default). A string is a u64 byte length and UTF-8 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
# scalar value types: struct format (little-endian)
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
# tensor types stored as plain numbers (the rest are quantized blocks: raw bytes)
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class MetaField:
    """One metadata value: decoded on the first ``contents()`` call (str, int, float, bool,
    or a list of them). ``count``: the number of elements of an array (1 for a scalar)."""

    def __init__(self, buf: memoryview, offset: int, value_type: int, elem_type: int | None,
                 count: int) -> None:
        self._buf, self._offset = buf, offset
        self.value_type, self.elem_type, self.count = value_type, elem_type, count
        self._value: Any = None
        self._decoded = False

    def contents(self) -> Any:
        if not self._decoded:
            self._value = self._decode()
            self._decoded = True
        return self._value

    def _decode(self) -> Any:
        if self.value_type != GGUFValueType.ARRAY:
            return _read_scalar(self._buf, self._offset, self.value_type)[0]
        if self.elem_type == GGUFValueType.STRING:
            out, offset = [], self._offset
            for _ in range(self.count):
                text, offset = _read_string(self._buf, offset)
                out.append(text)
            return out
        fmt = _SCALARS[GGUFValueType(self.elem_type)]
        values = np.frombuffer(self._buf, dtype=np.dtype(fmt), count=self.count,
                               offset=self._offset)
        return values.tolist()


@dataclass
class TensorInfo:
    """One tensor: ``shape`` in ggml order (fastest dim first, as ``GGUFReader`` gives it);
    ``data`` a read-only numpy view of the memory map (see the module docstring)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


class GGUFFile:
    """``fields`` (key -> MetaField) and ``tensors`` (in file order) of the GGUF at ``path``."""

    def __init__(self, path: str | Path) -> None:
        self._map = np.memmap(path, mode="r")
        buf = memoryview(self._map)
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        offset = 24
        self.fields: dict[str, MetaField] = {}
        for _ in range(n_fields):
            key, offset = _read_string(buf, offset)
            self.fields[key], offset = _field(buf, offset)
        infos = []
        for _ in range(n_tensors):
            name, offset = _read_string(buf, offset)
            (n_dims,) = struct.unpack_from("<I", buf, offset)
            dims = np.frombuffer(buf, dtype="<u8", count=n_dims, offset=offset + 4).copy()
            kind, rel = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
            infos.append((name, dims, GGMLQuantizationType(kind), rel))
            offset += 4 + 8 * n_dims + 12
        align = self.fields.get("general.alignment")
        align = 32 if align is None else int(align.contents())
        start = -(-offset // align) * align
        self.tensors = [TensorInfo(name, kind, dims, self._view(start + rel, dims, kind))
                        for name, dims, kind, rel in infos]

    def _view(self, offset: int, dims: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
        shape = tuple(int(d) for d in reversed(dims))
        n = int(np.prod(shape)) if shape else 1
        if kind in _PLAIN:
            dtype = np.dtype(_PLAIN[kind])
            return np.frombuffer(self._map, dtype=dtype, count=n, offset=offset).reshape(shape)
        block, type_size = GGML_QUANT_SIZES[kind]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=n * type_size // block,
                            offset=offset)
        return raw.reshape(quant_shape_to_byte_shape(shape, kind))


def _read_string(buf: memoryview, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offset)
    start = offset + 8
    return str(buf[start:start + n], "utf-8"), start + n


def _read_scalar(buf: memoryview, offset: int, value_type: int) -> tuple[Any, int]:
    if value_type == GGUFValueType.STRING:
        return _read_string(buf, offset)
    fmt = _SCALARS[GGUFValueType(value_type)]
    return struct.unpack_from(fmt, buf, offset)[0], offset + struct.calcsize(fmt)


def _field(buf: memoryview, offset: int) -> tuple[MetaField, int]:
    """The metadata value at ``offset`` (after its key) and the offset after it; an array
    is stepped over without decoding its elements."""
    (value_type,) = struct.unpack_from("<I", buf, offset)
    offset += 4
    if value_type != GGUFValueType.ARRAY:
        field = MetaField(buf, offset, value_type, None, 1)
        return field, _read_scalar(buf, offset, value_type)[1]
    elem_type, count = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    field = MetaField(buf, offset, value_type, elem_type, count)
    if elem_type == GGUFValueType.STRING:
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, offset)
            offset += 8 + n
    elif elem_type == GGUFValueType.ARRAY:
        raise ValueError("nested GGUF metadata arrays are not supported")
    else:
        offset += count * struct.calcsize(_SCALARS[GGUFValueType(elem_type)])
    return field, offset
