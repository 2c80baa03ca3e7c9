"""heron's C++ paged decode attention (the ``cpu`` backend) against the float64 reference and
the torch backend: ragged batches, GQA, sliding windows, shuffled block tables, bf16; and
HF-exact greedy generation through it."""

from __future__ import annotations

import pytest
import torch

from attention_steps import mixed_step
from hf_reference import hf_greedy, make_tiny_model
from heron import LLM, SamplingParams
from heron.attention import get_attention_backend
from heron.kernels import cases, cpu, reference


def test_the_kernel_builds_on_this_machine():
    assert cpu.load(), "heron's C++ CPU kernel did not build (see the log for why)"


@pytest.mark.parametrize("seq_lens,kv_heads,group,head_dim,block_size,window", [
    ([1], 1, 1, 16, 4, None),
    ([37, 5, 64, 1, 130], 3, 3, 64, 16, None),  # SmolLM2's heads
    ([29, 8, 17], 2, 4, 32, 4, 6),  # sliding window shorter than a block run
    ([100, 3, 16, 48], 1, 8, 64, 16, 40),  # multi-query, window across pages
    ([15, 16, 17, 33], 4, 1, 128, 16, None),  # page boundaries exactly
])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_matches_the_float64_reference(seq_lens, kv_heads, group, head_dim, block_size,
                                              window, dtype, tolerance):
    assert cpu.load()
    case = cases.attention_case([1] * len(seq_lens), seq_lens, kv_heads, group, head_dim,
                                block_size, dtype, seed=len(seq_lens), sliding_window=window)
    _, lens, tables = case.device_tensors()
    got = torch.ops.heron_cpu.paged_decode_attention(case.q, case.key_cache, case.value_cache,
                                                     tables, lens, case.scale, window or 0)
    assert got.dtype == dtype and got.shape == case.q.shape
    assert reference.max_rel_error(got, case.reference()) <= tolerance


@pytest.mark.parametrize("window", [None, 6])
def test_cpu_backend_equals_torch_backend_on_a_mixed_step(window):
    """Decodes take the kernel, prefill chunks (one after a cached prefix) the torch path."""
    q, k, v, kv_cache, md = mixed_step(window)
    outs, caches = [], []
    for name in ("torch", "cpu"):
        md.backend_cache.clear()
        cache = kv_cache.clone()
        outs.append(get_attention_backend(name).forward(q, k, v, cache, md, 0.125, window))
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    assert reference.max_rel_error(outs[1], outs[0]) <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: sliding window 24
def test_greedy_generation_through_the_kernel_matches_hf(arch, tmp_path):
    hf = make_tiny_model(arch, tmp_path)
    prompts = [[5 + i for i in range(n)] for n in (3, 19, 40)]
    llm = LLM(str(tmp_path), attention_backend="cpu", max_model_len=128, block_size=4,
              max_num_batched_tokens=16)
    assert llm.engine.runner.backend.name == "cpu"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)[0]
