"""heron's lazy GGUF reader against the ``gguf`` package's ``GGUFReader`` (the reference
tool for the format): every metadata value (scalars of each type, string and number arrays)
and every tensor (plain and quantized types, their shapes and bytes) read the same; a file
that is not GGUF is refused with a clear error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from heron.loader.gguf_file import GGUFFile


def _write(path):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_int32("test.i32", -3)
    w.add_uint64("test.u64", 1 << 40)
    w.add_int8("test.i8", -1)
    w.add_float32("test.f32", 0.25)
    w.add_float64("test.f64", 1e-300)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héron")
    w.add_array("test.tokens", ["<s>", "a", "", "ü" * 5] * 1000)
    w.add_array("test.scores", [0.5, -1.0, 2.0])
    w.add_array("test.types", [1, 2, 3, 6])
    w.add_custom_alignment(64)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    q8 = quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_field_and_tensor_reads_as_the_reference_reader(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path)
    mine, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert list(mine.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, field in mine.fields.items():
        assert field.contents() == ref.fields[key].contents(), key
    assert mine.fields["test.tokens"].count == 4000
    assert mine.fields["test.str"].contents() == "héron"
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(mine.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)
