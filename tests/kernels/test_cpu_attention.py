"""heron's C++ paged attention kernels (the ``cpu`` backend) against the float64 reference and
the torch backend: the decode op, and the varlen op on ragged prefill chunks (prefix hits,
chunks crossing pages, mixed with decodes), GQA, sliding windows, shuffled block tables, bf16;
and HF-exact greedy generation through it."""

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


# (q_lens, seq_lens, kv_heads, group, head_dim, block_size, window); a request's queries are
# the last q_len of its seq_len positions, so seq_len > q_len is a chunk after a cached prefix
_PREFILL = [
    ([1], [1], 1, 1, 16, 4, None),
    ([2], [2], 1, 1, 16, 4, None),  # the smallest prefill chunk
    ([37, 5, 64, 1, 130], [37, 40, 64, 90, 300], 3, 3, 64, 16, None),  # SmolLM2's heads, mixed
    ([29, 8, 17], [29, 50, 17], 2, 4, 32, 4, 6),  # window shorter than a block run
    ([100, 3, 16, 48], [100, 60, 16, 200], 1, 8, 64, 16, 40),  # multi-query, window over pages
    ([15, 16, 17, 33, 17], [15, 32, 17, 49, 40], 4, 1, 128, 16, None),  # page boundaries
    ([200, 1, 70], [456, 300, 70], 3, 3, 64, 16, 100),  # many query tiles, window across them
    ([9, 1, 23], [30, 12, 23], 2, 2, 20, 4, None),  # head_dim not a multiple of 8
    ([250], [250], 2, 1, 64, 16, None),  # group 1: tiles of 96 queries, a ragged last one
    ([250, 1], [300, 7], 2, 1, 32, 16, 5),  # rows whose first key step is all outside the window
]


@pytest.mark.parametrize("q_lens,seq_lens,kv_heads,group,head_dim,block_size,window", _PREFILL)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_varlen_kernel_matches_the_float64_reference(q_lens, seq_lens, kv_heads, group,
                                                     head_dim, block_size, window, dtype,
                                                     tolerance):
    assert cpu.load()
    case = cases.attention_case(q_lens, seq_lens, kv_heads, group, head_dim, block_size, dtype,
                                seed=len(q_lens) + head_dim, sliding_window=window)
    got = cases.run_cpu_attention(case)
    assert got.dtype == dtype and got.shape == case.q.shape
    assert reference.max_rel_error(got, case.reference()) <= tolerance


def test_varlen_kernel_reads_q_as_a_view_of_fused_qkv():
    """The model passes q as a slice of (T, H + 2 * KVH, D): a token stride that is not H * D."""
    assert cpu.load()
    case = cases.attention_case([20, 1, 7], [20, 9, 30], 2, 3, 64, 4, torch.float32, seed=5)
    starts, seq_lens, tables = case.device_tensors()
    qkv = torch.cat([case.q, cases.randn(case.q.shape[0], 4, 64, dtype=torch.float32, seed=6)], 1)
    q = qkv[:, :6]
    assert not q.is_contiguous()
    got = torch.ops.heron_cpu.paged_attention(q, case.key_cache, case.value_cache, tables,
                                              seq_lens, starts, case.scale, 0)
    assert reference.max_rel_error(got, case.reference()) <= 1e-5


def test_varlen_kernel_rejects_a_chunk_longer_than_its_sequence():
    assert cpu.load()
    case = cases.attention_case([4], [4], 1, 1, 16, 4, torch.float32)
    starts, _, tables = case.device_tensors()
    with pytest.raises(RuntimeError, match="exceeds its sequence length"):
        torch.ops.heron_cpu.paged_attention(case.q, case.key_cache, case.value_cache, tables,
                                            torch.tensor([3]), starts, case.scale, 0)


def test_varlen_kernel_rejects_a_block_outside_the_pool():
    assert cpu.load()
    case = cases.attention_case([3, 4], [5, 4], 1, 1, 16, 4, torch.float32)
    starts, seq_lens, tables = case.device_tensors()
    tables[0, 1] = case.key_cache.shape[0]
    with pytest.raises(RuntimeError, match="is not in the pool"):
        torch.ops.heron_cpu.paged_attention(case.q, case.key_cache, case.value_cache, tables,
                                            seq_lens, starts, case.scale, 0)


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,window", [
    (3, 3, 64, 16, None),  # SmolLM2
    (2, 4, 128, 16, None),  # the value rows in two register blocks
    (1, 8, 96, 4, 70),  # a block and a tail; window across pages
    (4, 1, 40, 16, None),  # a tail only
    (2, 2, 20, 4, 9),  # head_dim not a multiple of 8: the tiled routine itself
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_is_the_same_bits_as_its_row_inside_a_chunk(kv_heads, group, head_dim,
                                                             block_size, window, dtype):
    """A one-query chunk takes its own routine (one query fills few of the tiled routine's
    lanes); its output must be the bits the same position gets inside a longer chunk."""
    assert cpu.load()
    seq_len, q_len = 203, 70  # key steps of 64: three whole, one partial
    case = cases.attention_case([q_len], [seq_len], kv_heads, group, head_dim, block_size,
                                dtype, seed=head_dim, sliding_window=window)
    starts, lens, tables = case.device_tensors()
    attend = torch.ops.heron_cpu.paged_attention
    whole = attend(case.q, case.key_cache, case.value_cache, tables, lens, starts, case.scale,
                   window or 0)
    for row in (0, 1, 31, q_len - 1):
        pos = seq_len - q_len + row
        alone = attend(case.q[row:row + 1], case.key_cache, case.value_cache, tables,
                       torch.tensor([pos + 1]), torch.tensor([0, 1]), case.scale, window or 0)
        assert torch.equal(alone[0], whole[row]), f"position {pos}"


@pytest.mark.parametrize("kv_heads,group,head_dim,window", [(3, 3, 64, None), (2, 4, 128, 70),
                                                            (4, 1, 40, None)])
def test_a_decode_batch_is_the_same_bits_as_each_decode_alone(kv_heads, group, head_dim,
                                                              window):
    """Many decodes in one call are planned one item per request over all its KV heads (rows
    read whole), a few one item per KV head: a decode's bits do not depend on which."""
    assert cpu.load()
    seq_lens = [1, 63, 64, 65, 130, 203, 17, 300, 96, 5]
    case = cases.attention_case([1] * len(seq_lens), seq_lens, kv_heads, group, head_dim, 16,
                                torch.float32, seed=7, sliding_window=window)
    starts, lens, tables = case.device_tensors()
    attend = torch.ops.heron_cpu.paged_attention
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # 10 requests: whole-request items at 1 and 2 threads
            torch.set_num_threads(n)
            batch = attend(case.q, case.key_cache, case.value_cache, tables, lens, starts,
                           case.scale, window or 0)
            for i in range(len(seq_lens)):
                alone = attend(case.q[i:i + 1], case.key_cache, case.value_cache,
                               tables[i:i + 1], lens[i:i + 1], torch.tensor([0, 1]),
                               case.scale, window or 0)
                assert torch.equal(alone[0], batch[i]), f"request {i} at {n} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [None, 6])
def test_cpu_backend_equals_torch_backend_on_a_mixed_step(window):
    """Decodes and prefill chunks (one after a cached prefix) all go through the kernel."""
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
