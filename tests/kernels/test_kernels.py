"""Every Triton kernel against its float64 torch reference, under the Triton CPU interpreter.

Relative error is max |out - ref| / max |ref|; float32 must stay within 1e-5. Attention cases
cover ragged batches, prefixes already in the cache, GQA ratios 1/4/8, head dims 64 and 128,
sliding windows, several KV block sizes and shuffled (non-contiguous) block tables.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton kernel is defined

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from heron.kernels import cases, reference  # noqa: E402
from heron.kernels.activation import silu_and_mul  # noqa: E402
from heron.kernels.kv_store import store_kv  # noqa: E402
from heron.kernels.rmsnorm import rms_norm  # noqa: E402
from heron.kernels.rotary import apply_rotary  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# (num_kv_heads, group): GQA ratios 1, 4 and 8 with at most 8 query heads
GQA = [(4, 1), (2, 4), (1, 8)]


def _check(out, ref, dtype):
    assert ref.abs().max() > 0, "degenerate reference"
    err = reference.max_rel_error(out, ref)
    assert err <= TOL[dtype], f"max relative error {err:.2e} > {TOL[dtype]:.0e}"


def _assert_tables_shuffled(case: cases.AttentionCase):
    flat = [b for table in case.block_tables for b in table]
    assert flat != sorted(flat), "block tables happen to be contiguous: pick another seed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,group", GQA)
def test_prefill_ragged_with_prefix(kv_heads, group, head_dim, dtype):
    # request 0: fresh prompt; 1: chunk after a 9-token prefix; 2: one query (a decode);
    # 3: a chunk longer than one query tile after a prefix spanning several blocks
    case = cases.attention_case([6, 7, 1, 20], [6, 16, 30, 53], kv_heads, group, head_dim,
                                block_size=16, dtype=dtype, seed=head_dim + group)
    _assert_tables_shuffled(case)
    _check(cases.run_prefill(case), case.reference(), dtype)


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_sliding_window_small_blocks(block_size):
    case = cases.attention_case([5, 19, 12], [5, 40, 70], 2, 4, 64, block_size, torch.float32,
                                seed=block_size, sliding_window=9)
    _check(cases.run_prefill(case), case.reference(), torch.float32)


def test_prefill_bf16_upcast():
    case = cases.attention_case([3, 18], [10, 18], 2, 4, 64, 16, torch.bfloat16, seed=3)
    _check(cases.run_prefill(case), case.reference(), torch.bfloat16)


def test_reference_depends_on_block_table():
    """Negative control: pointing one table entry at another request's block moves the
    reference far from the kernel output, so the tests above really check paging."""
    case = cases.attention_case([4, 4], [20, 20], 2, 4, 64, 4, torch.float32, seed=5)
    out = cases.run_prefill(case)
    case.block_tables[1][0] = case.block_tables[0][0]
    assert reference.max_rel_error(out, case.reference()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,group", GQA)
def test_decode_split_kv(kv_heads, group, head_dim, dtype):
    case = cases.attention_case([1, 1, 1, 1], [1, 17, 64, 150], kv_heads, group, head_dim,
                                block_size=16, dtype=dtype, seed=group * 7 + head_dim)
    _assert_tables_shuffled(case)
    _check(cases.run_decode(case, num_splits=4), case.reference(), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 32])
def test_decode_split_counts_and_window(num_splits):
    # 32 splits of a 150-token context leave most splits empty; the window drops early keys
    case = cases.attention_case([1, 1, 1], [2, 70, 150], 2, 4, 64, 8, torch.float32,
                                seed=num_splits, sliding_window=33)
    _check(cases.run_decode(case, num_splits), case.reference(), torch.float32)


def test_decode_padding_row_is_zero():
    """seq_len 0 (a CUDA-graph padding row) gives zeros, and the other rows are unaffected."""
    case = cases.attention_case([1, 1], [0, 40], 2, 4, 64, 16, torch.float32, seed=2)
    out = cases.run_decode(case, num_splits=4)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _check(out[1:], case.reference()[1:], torch.float32)


def test_store_kv_strided_inputs_and_skipped_slots():
    qkv = cases.randn(7, 12, 64, dtype=torch.float32)  # k, v as strided views, like the model
    k, v = qkv[:, 8:10], qkv[:, 10:12]  # (T, KVH=2, D)
    key_cache = cases.randn(5, 4, 2, 64, dtype=torch.float32, seed=1)
    value_cache = cases.randn(5, 4, 2, 64, dtype=torch.float32, seed=2)
    slots = [17, 3, -1, 0, 19, 8, -1]
    ref_k, ref_v = reference.store_kv(k, v, key_cache, value_cache, slots)
    store_kv(k, v, key_cache, value_cache, torch.tensor(slots))
    assert torch.equal(key_cache.double(), ref_k) and torch.equal(value_cache.double(), ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    x = cases.randn(6, 200, dtype=dtype)  # 200: a masked, non-power-of-two row
    weight = cases.randn(200, dtype=dtype, seed=1)
    residual = cases.randn(6, 200, dtype=dtype, seed=2) if with_residual else None
    out = rms_norm(x, weight, 1e-6, residual)
    ref = reference.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        _check(out[1], ref[1], dtype)
        out, ref = out[0], ref[0]
    _check(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_on_a_strided_slice(dtype, head_dim):
    qk = cases.randn(5, 12, head_dim, dtype=dtype)
    x = qk[:, :10]  # (T, 10 heads, D) slice of a wider tensor, as the model passes q
    angles = cases.randn(5, 1, head_dim // 2, dtype=torch.float32, seed=3) * 3
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    _check(apply_rotary(x, cos, sin), reference.apply_rotary(x, cos, sin), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_multi_block(dtype):
    x = cases.randn(3, 2 * 1100, dtype=dtype) * 4  # d = 1100 spans two column blocks
    _check(silu_and_mul(x), reference.silu_and_mul(x), dtype)


def test_check_kernels_command(capsys, monkeypatch):
    from heron.entrypoints.cli import main
    from heron.kernels import check

    argv = ["check-kernels", "--device", "cpu", "--kernels", "store_kv,silu_and_mul",
            "--dtypes", "float32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "silu_and_mul" in out and "2/2 within tolerance" in out
    monkeypatch.setitem(check.TOLERANCE, torch.float32, 0.0)  # store_kv is exact, silu not
    assert main(argv) == 1
    assert "1/2 within tolerance" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_int_gemm_matches_reference(dtype):
    from heron.kernels import check

    errors = [reference.max_rel_error(*run())
              for run in check.SUITE["grouped_int_gemm"](dtype, "cpu", False)]
    assert len(errors) == 4 and max(errors) <= TOL[dtype]
