"""heron/kernels/cpu/small_ops.cpp: RMSNorm (plain and with the residual add), rotary,
SiLU-and-mul and the KV-cache write against the torch formulas the layers use elsewhere
(HF's order of operations), and the layers' dispatch to them on CPU float32 only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heron.kernels import cpu
from heron.layers import dispatch
from heron.layers.activation import silu_and_mul
from heron.layers.norm import RMSNorm
from heron.layers.rotary import _rotate_half, apply_rotary

pytestmark = pytest.mark.skipif(not cpu.load(), reason="heron's CPU kernels did not build")
ops = torch.ops.heron_cpu if cpu.load() else None


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-6) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert (a - b).abs().max().item() <= rel * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("tokens,width", [(1, 576), (7, 64), (3, 13), (33, 1000)])
def test_rms_norm_and_its_residual_add(tokens, width):
    g = torch.Generator().manual_seed(tokens * width)
    x, residual = torch.randn(tokens, width, generator=g), torch.randn(tokens, width, generator=g)
    weight = torch.randn(width, generator=g)
    _close(ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (width,), weight, 1e-6))
    normed, total = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, x + residual)
    _close(normed, F.rms_norm(x + residual, (width,), weight, 1e-6))
    strided = torch.randn(width, tokens, generator=g).t()  # rows not contiguous
    _close(ops.rms_norm(strided, weight, 1e-6), F.rms_norm(strided, (width,), weight, 1e-6))


@pytest.mark.parametrize("head_dim", [64, 128, 10])
def test_rotary_on_the_q_and_k_heads_of_a_fused_qkv(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(5, 9 + 2 * 3, head_dim, generator=g)
    qk = qkv[:, :12]  # (T, H + KVH, D), strided over T as in the model
    cos, sin = torch.randn(5, 1, head_dim, generator=g), torch.randn(5, 1, head_dim, generator=g)
    expect = qk * cos + _rotate_half(qk) * sin
    _close(ops.rotary(qk, cos.view(5, -1), sin.view(5, -1)), expect)
    _close(apply_rotary(qk, cos, sin), expect)


def test_silu_and_mul_over_the_float_range():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(4, 2 * 200, generator=g) * 8
    gate_up[0, :9] = torch.tensor([-1e4, -104.0, -88.0, -20.0, 0.0, 1e-6, 20.0, 88.0, 1e4])
    gate, up = gate_up.chunk(2, dim=-1)
    expect = F.silu(gate) * up
    got = ops.silu_and_mul(gate_up)
    assert torch.isfinite(got).all()
    assert ((got - expect).abs() <= 4e-7 * expect.abs() + 1e-30).all()
    _close(silu_and_mul(gate_up), expect, rel=1e-6)


def test_write_kv_fills_the_slots_and_refuses_others():
    key_cache, value_cache = torch.zeros(4, 2, 3, 8), torch.zeros(4, 2, 3, 8)
    kv = torch.randn(3, 2 * 3, 8)
    k, v = kv[:, :3], kv[:, 3:]  # views of one tensor, as the model's split leaves them
    slots = torch.tensor([5, 0, 7])
    ops.write_kv(k, v, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(-1, 3, 8), value_cache.view(-1, 3, 8)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    assert flat_k[[1, 2, 3, 4, 6]].abs().sum() == 0
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv(k, v, key_cache, value_cache, torch.tensor([0, 8, 1]))


def test_layers_use_the_kernels_for_cpu_float32_inference_only(monkeypatch):
    norm = RMSNorm(16, 1e-5)
    norm.weight.data.normal_()
    x = torch.randn(3, 16)
    calls = []
    real = ops.rms_norm
    monkeypatch.setattr(torch.ops.heron_cpu, "rms_norm",
                        lambda *a: calls.append(a) or real(*a), raising=False)
    with torch.inference_mode():
        norm(x)
        assert len(calls) == 1
        assert dispatch.cpu_ops_enabled(x) and not dispatch.cpu_ops_enabled(x.bfloat16())
        half = norm.to(torch.bfloat16)(x.bfloat16())  # the torch formula, not the kernel
        assert half.dtype == torch.bfloat16 and len(calls) == 1
    trained = RMSNorm(16, 1e-5)
    trained.weight.data.normal_()
    trained.weight.requires_grad_(True)
    trained(x).sum().backward()  # autograd on: the torch formula, which has a backward
    assert len(calls) == 1 and trained.weight.grad is not None
