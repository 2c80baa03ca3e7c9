"""layers.cpu_gemm: both layouts (column-major GEMV, oneDNN-packed GEMM) equal a float64
matmul at every row count, with and without bias, and models loaded on CPU use them."""

from __future__ import annotations

import pytest
import torch

from heron.layers.cpu_gemm import GEMV_MAX_ROWS, CpuGemm, CpuGemmMethod, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_both_layouts_equal_a_float64_matmul(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if with_bias else None
    x = torch.randn(rows, 96, generator=g)
    ref = x.double() @ w.double().t() + (b.double() if with_bias else 0)
    got = CpuGemm(w, dual=True)(x, b)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    assert (got.double() - ref).abs().max() / ref.abs().max() < 1e-5
    packed_only = CpuGemm(w, dual=False)(x, b)  # no GEMV copy: the packed path always
    assert (packed_only.double() - ref).abs().max() / ref.abs().max() < 1e-5


def test_loaded_models_use_both_layouts(tmp_path):
    from heron import LLM
    from hf_reference import make_tiny_model

    make_tiny_model("llama", tmp_path)
    llm = LLM(str(tmp_path), num_kv_blocks=8, block_size=4)
    model = llm.engine.runner.model
    proj = model.model.layers[0].mlp.gate_up_proj
    method = proj.quant_method
    assert isinstance(method, CpuGemmMethod)
    assert proj.weight.data_ptr() == method.gemm.gemv.data_ptr()
    assert proj.weight.stride() == (1, proj.weight.shape[0])  # column-major
    assert isinstance(model.lm_head.quant_method, CpuGemmMethod)
