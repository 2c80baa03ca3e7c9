"""heron's grouped integer weight layout (``heron.quant.int_layout``) and the CPU kernel that
multiplies it (``torch.ops.heron_cpu.quant_linear``), with the torch fallback, against a
float64 reference: decode-sized and prefill-sized batches (the GEMV and the dequantize + GEMM
paths), 2..8 bits, groups of 16 .. K, odd and single output features, and bad shapes.

Errors are max |y - ref| / max (|x| @ |w|.T): the scale of a float32 dot product's rounding.
Dividing by max |ref| instead blows up where a lone output cancels to near zero (float32 torch
itself is off by ~3e-4 that way on one 8-bit output); cases with many outputs check that too.
"""

from __future__ import annotations

import pytest
import torch

from heron.kernels import cpu, reference
from heron.quant import int_layout
from heron.quant.int_layout import (GroupedIntWeight, dequantize, pack_values, quant_linear,
                                    unpack_values)

TOLERANCE = 1e-5


def _weight(n: int, k: int, bits: int, group: int, seed: int = 0) -> GroupedIntWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, k // group), generator=g).float()
    return GroupedIntWeight.from_values(q, scales, -zeros * scales, group, bits)


def _check(y: torch.Tensor, x: torch.Tensor, w: GroupedIntWeight) -> None:
    wd = w.dequantize().double()
    ref = x.double() @ wd.T
    assert y.dtype == torch.float32 and y.shape == ref.shape
    scale = (x.double().abs() @ wd.abs().T).max().item()
    assert (y.double() - ref).abs().max().item() / scale <= TOLERANCE
    if ref.numel() >= 64:
        assert reference.max_rel_error(y, ref) <= TOLERANCE


def _op(x: torch.Tensor, w: GroupedIntWeight) -> torch.Tensor:
    return torch.ops.heron_cpu.quant_linear(x, w.qweight, w.scales, w.mins, w.group_size,
                                            w.bits)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("k", [48, 64, 136])  # a partial chunk, one chunk, two and a part
def test_pack_unpack_round_trip(bits, k):
    q = torch.randint(0, 1 << bits, (5, k), dtype=torch.int32)
    packed = pack_values(q, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == ((5, -(-k // 64) * 32) if bits <= 4 else (5, k))
    assert torch.equal(unpack_values(packed, bits, k).long(), q.long())


def test_nibble_layout_is_the_documented_one():
    q = torch.randint(0, 16, (1, 128))  # two chunks of 64
    packed = pack_values(q, 4)[0].tolist()
    for c in range(2):
        chunk = packed[32 * c:32 * (c + 1)]
        # byte 4j + b: value 16b + j in the low nibble, 16b + 8 + j in the high one
        for j in range(8):
            for b in range(4):
                byte = chunk[4 * j + b]
                assert byte & 0xF == q[0, 64 * c + 16 * b + j]
                assert byte >> 4 == q[0, 64 * c + 16 * b + 8 + j]
        # word j, bits 4i .. 4i + 3: value 8i + j (run i is the chunk shifted by 4i)
        words = [int.from_bytes(bytes(chunk[4 * j:4 * j + 4]), "little") for j in range(8)]
        assert [(words[j] >> (4 * i)) & 0xF for i in range(8) for j in range(8)] == \
            q[0, 64 * c:64 * (c + 1)].tolist()


def test_dequantize_is_q_times_scale_plus_min():
    w = _weight(3, 32, 5, 16)
    q = unpack_values(w.qweight, 5, 32).float()
    expect = torch.stack([q[:, i] * w.scales[:, i // 16] + w.mins[:, i // 16]
                          for i in range(32)], dim=1)
    assert torch.equal(w.dequantize(), expect)


def test_the_kernel_builds_and_registers_the_op():
    assert cpu.load()
    assert hasattr(torch.ops.heron_cpu, "quant_linear")


@pytest.mark.parametrize("m", [1, 3, 8, 12, 13, 17, 64])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("group", [16, 32, 128, 256])
def test_kernel_and_fallback_match_the_float64_reference(m, bits, group):
    assert cpu.load()
    w = _weight(100, 256, bits, group, seed=m * 7 + bits)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    _check(_op(x, w), x, w)
    _check(int_layout._quant_linear_torch(x, w), x, w)


@pytest.mark.parametrize("m", [1, 3, 13, 64])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 256), (8, 16), (8, 256)])
def test_a_single_output_feature(m, bits, group):
    w = _weight(1, 256, bits, group, seed=m)
    x = torch.randn(m, 256)
    _check(_op(x, w), x, w)
    _check(int_layout._quant_linear_torch(x, w), x, w)


@pytest.mark.parametrize("bits", [2, 3, 7])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_other_widths(bits, m):
    w = _weight(37, 64, bits, 32, seed=bits)
    x = torch.randn(m, 64)
    _check(_op(x, w), x, w)


@pytest.mark.parametrize("m", [1, 2, 9, 24, 25, 33])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 576), (6, 16)])
def test_smollm2_width(m, bits, group):
    w = _weight(75, 576, bits, group, seed=m)
    x = torch.randn(m, 576)
    _check(_op(x, w), x, w)


@pytest.mark.parametrize("k,group", [
    (192, 8), (192, 16), (192, 32), (192, 64), (192, 192),  # the chunked GEMV, each group shape
    (192, 24), (192, 48), (96, 32), (40, 8), (200, 40),  # the run-by-run GEMV: 64 does not fit
])
@pytest.mark.parametrize("bits", [3, 4])
def test_every_decode_path_of_the_nibble_layout(k, group, bits):
    w = _weight(21, k, bits, group, seed=k + group)
    x = torch.randn(1, k)
    _check(_op(x, w), x, w)
    _check(_op(x.repeat(5, 1), w), x.repeat(5, 1), w)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 5, 20])
def test_groups_of_eight(bits, m):
    w = _weight(19, 64, bits, 8, seed=m)
    x = torch.randn(m, 64)
    _check(_op(x, w), x, w)


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts_agree(threads):
    w = _weight(203, 128, 4, 32)
    x = torch.randn(20, 128)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 4, 20):
            _check(_op(x[:rows], w), x[:rows], w)
    finally:
        torch.set_num_threads(before)


def test_quant_linear_takes_leading_dims_and_non_contiguous_x():
    w = _weight(24, 64, 4, 32)
    x = torch.randn(2, 3, 128)[..., ::2]
    y = quant_linear(x, w)
    assert y.shape == (2, 3, 24)
    _check(y.reshape(6, 24), x.reshape(6, 64), w)


def test_the_fallback_runs_when_the_kernel_is_unavailable(monkeypatch):
    w = _weight(50, 64, 6, 16)
    x = torch.randn(4, 64)
    monkeypatch.setattr(int_layout, "_kernel_ready", lambda: False)
    monkeypatch.setattr(int_layout, "_FALLBACK_TILE_FLOATS", 64 * 7)  # tiles of 7 rows
    _check(quant_linear(x, w), x, w)


def test_narrow_rows_is_a_column_shard():
    w = _weight(30, 64, 4, 16)
    shard = w.narrow_rows(10, 12)
    assert (shard.out_features, shard.in_features) == (12, 64)
    assert torch.equal(shard.dequantize(), w.dequantize()[10:22])
    x = torch.randn(3, 64)
    assert torch.allclose(quant_linear(x, shard), quant_linear(x, w)[:, 10:22])
    with pytest.raises(ValueError, match="outside"):
        w.narrow_rows(20, 11)


def test_nbytes():
    w = _weight(10, 64, 4, 32)
    assert w.nbytes == 10 * 32 + 2 * 10 * 2 * 4
    assert _weight(10, 64, 8, 64).nbytes == 10 * 64 + 2 * 10 * 4


def test_empty_batch():
    w = _weight(10, 64, 4, 32)
    assert _op(torch.empty(0, 64), w).shape == (0, 10)


def test_layout_errors():
    with pytest.raises(ValueError, match="lie in"):
        pack_values(torch.tensor([[16] + [0] * 7]), 4)
    with pytest.raises(ValueError, match="lie in"):
        pack_values(torch.tensor([[-1] + [0] * 7]), 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_values(torch.zeros(2, 12, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="integer"):
        pack_values(torch.zeros(2, 8), 4)
    with pytest.raises(ValueError, match="2-D"):
        pack_values(torch.zeros(8, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="bits"):
        pack_values(torch.zeros(2, 8, dtype=torch.int64), 9)
    with pytest.raises(ValueError, match="must be"):
        unpack_values(torch.zeros(2, 8, dtype=torch.uint8), 4, 8)
    with pytest.raises(ValueError, match="divide"):
        GroupedIntWeight.from_values(torch.zeros(2, 48, dtype=torch.int64), torch.ones(2, 1),
                                     torch.zeros(2, 1), 32, 4)
    w = _weight(4, 64, 4, 32)
    with pytest.raises(ValueError, match="scales and mins"):
        GroupedIntWeight(w.qweight, w.scales, w.mins[:, :1], 32, 4, 64, 4)
    with pytest.raises(ValueError, match="qweight"):
        dequantize(w.qweight[:, :16], w.scales, w.mins, 32, 4)
    with pytest.raises(ValueError, match="features"):
        quant_linear(torch.randn(2, 32), w)


def test_kernel_errors():
    assert cpu.load()
    w = _weight(4, 64, 4, 32)
    x = torch.randn(2, 64)
    op = torch.ops.heron_cpu.quant_linear
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), w.qweight, w.scales, w.mins, 32, 4)
    with pytest.raises(RuntimeError, match="bits"):
        op(x, w.qweight, w.scales, w.mins, 32, 9)
    with pytest.raises(RuntimeError, match="qweight"):
        op(x, w.qweight, w.scales, w.mins, 32, 8)  # 4-bit packing read as 8-bit
    with pytest.raises(RuntimeError, match="group_size"):
        op(x, w.qweight, w.scales, w.mins, 24, 4)
    with pytest.raises(RuntimeError, match="scales and mins"):
        op(x, w.qweight, w.scales[:, :1].contiguous(), w.mins[:, :1].contiguous(), 32, 4)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        op(torch.randn(2, 60), torch.zeros(4, 30, dtype=torch.uint8), torch.ones(4, 1),
           torch.zeros(4, 1), 60, 4)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x, torch.zeros(32, 4, dtype=torch.uint8).t(), w.scales, w.mins, 32, 4)


def test_fp8_linear_decodes_every_e4m3_value_exactly():
    """Every float8_e4m3fn byte but NaN (subnormals, both zeros, +-448): the identity times
    the weight gives back torch's own decoding of each byte."""
    assert cpu.load()
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    weight = codes[:248].view(torch.float8_e4m3fn).reshape(31, 8)
    y = torch.ops.heron_cpu.fp8_linear(torch.eye(8), weight, torch.ones(31))
    assert torch.equal(y.T, weight.to(torch.float32))


@pytest.mark.parametrize("m", [1, 3, 20])
def test_fp8_linear_matches_the_float64_reference(m):
    assert cpu.load()
    gen = torch.Generator().manual_seed(m)
    weight = (torch.randn(40, 96, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(40, generator=gen) + 0.5
    x = torch.randn(m, 96, generator=gen)
    w64 = weight.to(torch.float64) * scale.double()[:, None]
    y = torch.ops.heron_cpu.fp8_linear(x, weight, scale).double()
    ref = x.double() @ w64.T
    assert (y - ref).abs().max().item() <= TOLERANCE * (x.double().abs() @ w64.abs().T).max()
