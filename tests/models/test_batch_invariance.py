"""A request's greedy output does not depend on what else runs with it (issue 22, item 12).

Kernel level: every quantized linear path (the grouped-integer kernel behind GGUF, GPTQ, AWQ
and W8A8; FP8's kernel; the float32 ``CpuGemm`` in batch-invariant mode) gives one row the
same bits alone as inside a batch of 2..150 rows, for row counts that take each of the
kernel's paths (1, <= 12, > 12), group sizes of every format and K that leave partial sets;
paged attention gives a position the same bits however its chunk was cut (a decode, a
one-token chunk after a prefix hit, a long prompt) and whatever else is in the step.

Model level: for each weight format heron runs (tiny random Llama checkpoints written like
the reference tools write them, the real SmolLM2 GGUF, and n-gram speculation on), a
prompt's greedy tokens *and logprobs* alone equal those inside a batch of 32 mixed-length
requests. Exact equality is meaningful here, not lucky: every layer computes a row with the
same arithmetic whatever the batch (the kernel tests above), so the logprobs match to the
bit and a near-tie cannot break the comparison either way.
"""

from __future__ import annotations

import pytest
import torch

from heron import LLM, SamplingParams
from heron.kernels import cpu
from heron.layers import cpu_gemm
from heron.layers.cpu_gemm import CpuGemm
from heron.quant.int_layout import GroupedIntWeight, quant_linear
from quant_fixtures import write_quantized

ROW_COUNTS = [1, 2, 3, 5, 8, 12, 13, 16, 17, 32, 64, 65, 150]  # every kernel path and tile edge
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def _assert_rows_invariant(linear, k: int, seed: int = 0) -> None:
    """linear(x[:m])[i] == linear(x[i:i + 1])[0] bit for bit, for every m and row i < m."""
    x = torch.randn(max(ROW_COUNTS), k, generator=torch.Generator().manual_seed(seed))
    alone = torch.cat([linear(x[i:i + 1]) for i in range(x.shape[0])])
    for m in ROW_COUNTS:
        together = linear(x[:m])
        assert torch.equal(together, alone[:m]), f"{m} rows: row results depend on the batch"


def _grouped(n: int, k: int, bits: int, group: int) -> GroupedIntWeight:
    g = torch.Generator().manual_seed(bits * 1000 + group)
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, k // group), generator=g).float()
    return GroupedIntWeight.from_values(q, scales, -zeros * scales, group, bits)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not cpu.load():
        pytest.skip("heron's CPU kernels did not build")


FORMATS = [  # (bits, group size; None: one group per row)
    (4, 32),  # GGUF Q4_0 / Q4_1 / Q4_K, GPTQ / AWQ 4-bit g32
    (4, 64), (4, 128),  # GPTQ / AWQ larger groups
    (5, 32),  # GGUF Q5_K
    (6, 16),  # GGUF Q6_K
    (8, 32),  # GGUF Q8_0
    (8, None),  # W8A8 int8 per channel
    (3, 8), (2, 24),  # odd widths, and groups that straddle the kernel's sets of runs
]
WIDTHS = [192, 96, 72, 1536]  # whole nibble chunks, half a chunk, partial sets, a long K


@pytest.mark.parametrize("k,bits,group", [(k, b, g or k) for k in WIDTHS for b, g in FORMATS
                                          if k % (g or k) == 0])
def test_quant_linear_row_is_the_same_in_any_batch(k, bits, group):
    w = _grouped(40, k, bits, group)
    _assert_rows_invariant(lambda x: quant_linear(x, w), k)


@pytest.mark.parametrize("k", [72, 576])
def test_fp8_linear_row_is_the_same_in_any_batch(k):
    g = torch.Generator().manual_seed(k)
    weight = (torch.randn(40, k, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(40, generator=g) * 0.01 + 1e-3
    _assert_rows_invariant(lambda x: torch.ops.heron_cpu.fp8_linear(x, weight, scale), k)


def test_quant_linear_rows_do_not_depend_on_threads():
    w = _grouped(100, 576, 4, 32)
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append([quant_linear(x[:m], w) for m in (1, 8, 33)])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_float_cpu_gemm_is_batch_invariant_when_asked(monkeypatch):
    if not cpu_gemm.packing_available():
        pytest.skip("torch without oneDNN")
    weight = torch.randn(300, 576, generator=torch.Generator().manual_seed(2))
    gemm = CpuGemm(weight, dual=True)
    monkeypatch.setattr(cpu_gemm, "BATCH_INVARIANT", True)
    _assert_rows_invariant(gemm, 576)


@pytest.mark.parametrize("window", [0, 50, 100])
def test_attention_row_is_the_same_however_its_chunk_was_cut(window):
    """Paged attention of a position alone (a decode, or a one-token chunk after a prefix-cache
    hit) equals that position's row inside a longer chunk, and inside a mixed batch, bit for
    bit, with or without a sliding window: the chunking of a prompt depends on the other
    requests of a step (shared token budget, prefix hits), so it must not reach the result."""
    from heron.kernels import cases

    seq_len, q_len = 150, 100  # the chunk: positions 50 .. 149 (two query tiles)
    case = cases.attention_case([q_len], [seq_len], 3, 3, 64, 16, torch.float32, seed=4,
                                sliding_window=window or None)
    starts, lens, tables = case.device_tensors()
    attend = torch.ops.heron_cpu.paged_attention
    whole = attend(case.q, case.key_cache, case.value_cache, tables, lens, starts, case.scale,
                   window)
    for cut in ([1] * 3 + [97], [1, 99], [17, 1, 82], [99, 1], [30, 31, 39]):
        pos, rows = seq_len - q_len, []
        for n in cut:
            q = case.q[pos - (seq_len - q_len):][:n]
            pos += n
            rows.append(attend(q, case.key_cache, case.value_cache, tables,
                               torch.tensor([pos]), torch.tensor([0, n]), case.scale, window))
        assert torch.equal(torch.cat(rows), whole), f"chunks {cut}"
    if window:
        return
    # the same chunk as one request of a mixed step: decodes and prompts of other requests
    mixed = cases.attention_case([1, q_len, 7, 1], [90, seq_len, 30, 5], 3, 3, 64, 16,
                                 torch.float32, seed=4)
    got = cases.run_cpu_attention(mixed)
    _, m_lens, m_tables = mixed.device_tensors()
    for request in range(4):  # each request's rows alone equal its rows in the mixed step
        lo, hi = mixed.query_start_loc[request], mixed.query_start_loc[request + 1]
        alone = attend(mixed.q[lo:hi], mixed.key_cache, mixed.value_cache,
                       m_tables[request:request + 1], m_lens[request:request + 1],
                       torch.tensor([0, hi - lo]), mixed.scale, 0)
        assert torch.equal(alone, got[lo:hi]), f"request {request}"


# ---- model level ----

# Prefix caching off here (test_fp8_with_prefix_cache_hits_and_one_token_chunks turns it on):
# the batch then computes every prompt whole. The budget holds all 32 prompts' prefill in
# one step.
ENGINE = dict(num_kv_blocks=512, block_size=4, enable_prefix_caching=False,
              max_num_batched_tokens=2048)

def _mixed_prompts(count: int, seed: int, vocab: int) -> list[list[int]]:
    """count prompts of 3 .. 40 tokens (ids past the special ones)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 41, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _alone_and_in_batch(llm: LLM, prompts, checked: int = 3):
    """Outputs of prompts[:checked] run one at a time, and of all prompts run together."""
    alone = [llm.generate([p], GREEDY)[0].outputs[0] for p in prompts[:checked]]
    together = [o.outputs[0] for o in llm.generate(prompts, GREEDY)][:checked]
    return alone, together


def _assert_same(alone, together) -> None:
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # same bits: every layer computes a row alike


@pytest.fixture
def invariant_float(monkeypatch):
    """The tiny checkpoints keep a float32 LM head (``ignore: lm_head``)."""
    monkeypatch.setattr(cpu_gemm, "BATCH_INVARIANT", True)


@pytest.mark.parametrize("scheme", ["gptq-4bit-g32", "gptq-4bit-act-order", "awq-gemm-g32",
                                    "ct-w8a8-int8", "ct-fp8-dynamic", "ct-fp8-static"])
def test_checkpoint_greedy_output_alone_equals_in_a_batch_of_32(tiny, tmp_path, scheme,
                                                                invariant_float):
    write_quantized(tiny.path, tmp_path / scheme, scheme)
    llm = LLM(str(tmp_path / scheme), **ENGINE)
    _assert_same(*_alone_and_in_batch(llm, _mixed_prompts(32, 0, 512)))


def test_fp8_quantized_at_load_with_ngram_speculation(tiny, invariant_float):
    prompts = _mixed_prompts(32, 1, 512)
    prompts[0] = prompts[0][:6] * 4  # repeats: the n-gram proposer has drafts to offer
    llm = LLM(str(tiny.path), quantization="fp8", **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    _assert_same(*_alone_and_in_batch(llm, prompts))


def test_fp8_with_prefix_cache_hits_and_one_token_chunks(tiny, invariant_float):
    """Prefix caching on (the default): the batch finds the first prompt's blocks cached by
    its run alone, and prompts of 4k + 1 tokens sharing a 4k-token prefix leave one-token
    chunks after their hits; the output is still the same bits as alone."""
    shared = _mixed_prompts(1, 2, 512)[0][:3] * 4  # 12 tokens: three 4-token blocks
    prompts = [shared + [5 + i] for i in range(8)] + _mixed_prompts(24, 3, 512)
    llm = LLM(str(tiny.path), quantization="fp8", **{**ENGINE, "enable_prefix_caching": True})
    _assert_same(*_alone_and_in_batch(llm, prompts, checked=4))


def test_smollm2_gguf_greedy_output_alone_equals_in_a_batch_of_32():
    """The real model's GGUF (Q4_1 projections, a Q8_0 tied embedding / LM head): all of it
    through the quantized kernel, no float projection left."""
    llm = LLM(num_kv_blocks=256, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    texts = [f"Question {i}: what is {i} plus {i * 7}? " + "Think step by step. " * (i % 5)
             for i in range(32)]
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    alone = [llm.generate([p], params)[0].outputs[0] for p in prompts[:2]]
    together = [o.outputs[0] for o in llm.generate(prompts, params)][:2]
    _assert_same(alone, together)


def test_float_model_batch_invariant_through_the_environment(tiny, monkeypatch):
    """HERON_BATCH_INVARIANT=1 (vLLM's VLLM_BATCH_INVARIANT) reaches the worker: a float32
    model's greedy output and logprobs alone equal those in a batch of 32."""
    monkeypatch.setattr(cpu_gemm, "BATCH_INVARIANT", False)  # restored after the test
    monkeypatch.setenv("HERON_BATCH_INVARIANT", "1")
    llm = LLM(str(tiny.path), **ENGINE)
    assert cpu_gemm.BATCH_INVARIANT
    _assert_same(*_alone_and_in_batch(llm, _mixed_prompts(32, 4, 512)))
