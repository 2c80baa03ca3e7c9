"""heron_cpu::quant_linear_int8 (``--cpu-int8-dot``): grouped integer weights times
activations rounded to 8 bits per 32 features, with integer dot products.

The oracle is a float64 evaluation of the same arithmetic (the activations rounded exactly as
the kernel documents, the integer sums exact): the kernel must match it to float32 rounding.
It is not exact against the dequantized path (``quant_linear``); its distance from it is
bounded here, and its cost in perplexity on the real model in tests/models.
"""

from __future__ import annotations

import pytest
import torch

from heron.kernels import cpu
from heron.quant.int_layout import GroupedIntWeight, quant_linear

SHAPES = [  # bits, group_size, K, N, M
    (4, 32, 576, 96, 1),     # SmolLM2's Q4_1 projections, a decode
    (4, 32, 544, 40, 3),     # K % 64 == 32: a last half chunk
    (4, 64, 1536, 24, 5),    # groups of two blocks
    (4, 128, 256, 9, 11),    # tiles of 4 rows and a remainder
    (3, 32, 96, 17, 2),      # 3-bit values in nibbles
    (8, 32, 576, 64, 1),     # bytes: Q8_0's layout
    (6, 64, 128, 7, 6),      # 6-bit values in bytes
]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not cpu.load():
        pytest.skip("heron's CPU kernels did not build")


def _weight(bits: int, group: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
    mins = -scales * 2 ** (bits - 1) + torch.randn(n, k // group, generator=g) * 1e-3
    return q, GroupedIntWeight.from_values(q, scales, mins, group, bits)


def _reference(x: torch.Tensor, q: torch.Tensor, w: GroupedIntWeight) -> torch.Tensor:
    """float64 of the kernel's arithmetic: per block of 32, d = max|x| / 127 (float32),
    xq = round-half-even(x * 127 / max|x|) (float32 product), s = d * sum(xq);
    y = sum_b scale * d * (q . xq) + min * s."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = (amax / 127).double()
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv).double()  # torch.round: half to even, as nearbyint
    s = d[..., 0] * xq.sum(-1)  # (M, B)
    per_block = w.group_size // 32
    scales = w.scales.double().repeat_interleave(per_block, 1)  # (N, B)
    mins = w.mins.double().repeat_interleave(per_block, 1)
    isum = torch.einsum("mbk,nbk->mnb", xq, q.double().view(q.shape[0], k // 32, 32))
    return (isum * scales[None] * d[:, None, :, 0]).sum(-1) + (mins[None] * s[:, None]).sum(-1)


def _int8(x: torch.Tensor, w: GroupedIntWeight) -> torch.Tensor:
    return torch.ops.heron_cpu.quant_linear_int8(x, w.qweight, w.scales, w.mins, w.group_size,
                                                 w.bits)


@pytest.mark.parametrize("bits,group,k,n,m", SHAPES)
def test_matches_the_float64_evaluation_of_its_arithmetic(bits, group, k, n, m):
    q, w = _weight(bits, group, k, n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0.0  # an all-zero block: d = 0, no division by zero
    y, ref = _int8(x, w), _reference(x, q, w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("bits,group,k,n,m", SHAPES)
def test_a_row_is_the_same_bits_alone_or_in_any_batch(bits, group, k, n, m):
    _, w = _weight(bits, group, k, n)
    x = torch.randn(m + 4, k, generator=torch.Generator().manual_seed(2))
    together = _int8(x, w)
    for i in range(x.shape[0]):
        assert torch.equal(_int8(x[i:i + 1], w)[0], together[i])


@pytest.mark.parametrize("bits,group,k,n,m", SHAPES)
def test_close_to_the_dequantized_path(bits, group, k, n, m):
    """The activations' rounding costs at most about one part in 100 of the output's size
    (a block's step is max|x| / 127)."""
    _, w = _weight(bits, group, k, n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    exact = torch.ops.heron_cpu.quant_linear(x, w.qweight, w.scales, w.mins, group, bits)
    assert (_int8(x, w) - exact).abs().max() <= 0.02 * exact.abs().max()


def test_quant_linear_takes_the_int8_path_only_when_switched_on():
    q, w = _weight(4, 32, 64, 8)
    x = torch.randn(2, 64)
    exact = quant_linear(x, w)
    assert torch.equal(exact, torch.ops.heron_cpu.quant_linear(x, w.qweight, w.scales, w.mins,
                                                               32, 4))
    assert w.use_int8_activations() and w.int8_activations
    assert torch.equal(quant_linear(x, w), _int8(x, w))
    assert w.narrow_rows(0, 4).int8_activations  # a TP shard keeps the choice
    assert w.stack_form().kind == w.stack_form().GROUPED_INT8


def test_groups_finer_than_32_features_stay_exact():
    _, w = _weight(6, 16, 64, 8)  # Q6_K's sub-blocks of 16
    assert not w.use_int8_activations()
    assert w.stack_form().kind == w.stack_form().GROUPED


@pytest.mark.parametrize("bad", [
    dict(group_size=16),  # not a multiple of 32
    dict(bits=9),
    dict(x=torch.randn(1, 64, dtype=torch.float64)),
])
def test_bad_arguments_are_clear_errors(bad):
    _, w = _weight(4, 32, 64, 8)
    args = dict(x=torch.randn(1, 64), group_size=32, bits=4) | bad
    with pytest.raises(RuntimeError, match="quant_linear_int8"):
        torch.ops.heron_cpu.quant_linear_int8(args["x"], w.qweight, w.scales, w.mins,
                                              args["group_size"], args["bits"])
