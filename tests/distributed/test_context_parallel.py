"""Context parallelism over gloo on 127.0.0.1 (mp executor): CP=2 and CP=4 give one rank's
greedy tokens, seeded samples and logprobs (within 1e-5, float32) for prompts of many
blocks under chunked prefill with decodes mixed in, alone and with pipeline or tensor
parallelism, on a tiny Llama and on a tiny Qwen2 with a sliding-window layer (two KV cache
groups); each rank stores only the KV of its blocks (block id % N == its CP rank)."""

from __future__ import annotations

import random

import pytest

from hf_reference import assert_same_outputs, make_tiny_model
from heron import LLM, SamplingParams
from heron.config import CacheConfig, EngineConfig, ParallelConfig, SpeculativeConfig

MAX_NEW = 10
# block_size 4: the prompts are 3 to 24 blocks long; a 16-token budget chunks them and puts
# the first prompts' decodes in the same steps as the later prompts' chunks
ENGINE = dict(max_num_batched_tokens=16, block_size=4, num_kv_blocks=96, max_num_seqs=4,
              max_model_len=128)
PROMPT_LENS = (93, 41, 12, 66)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=MAX_NEW,
                            ignore_eos=True, logprobs=3)
    prompt_lps = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                logprobs=3, prompt_logprobs=2)
    return [greedy, seeded, prompt_lps, greedy]


def _run(path, prompts, **kwargs):
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        return llm.generate(prompts, _params()), llm.engine.stats()
    finally:
        llm.engine.shutdown()


def _kv_tokens(prompts) -> int:
    """KV tokens one rank writes for the whole run (the last sampled token's is never
    written; no preemption and no prefix hits here)."""
    return sum(len(p) + MAX_NEW - 1 for p in prompts)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", path, num_key_value_heads=2)
    prompts = _prompts(3)
    return path, prompts, _run(path, prompts)[0]


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_equals_one_rank(llama, cp):
    path, prompts, reference = llama
    outputs, stats = _run(path, prompts, context_parallel_size=cp)
    assert_same_outputs(reference, outputs, 1e-5)
    stored, total = [r.kv_tokens_stored for r in stats.ranks], _kv_tokens(prompts)
    assert len(stored) == cp and sum(stored) == total
    assert all(total / (2 * cp) < n < 2 * total / cp for n in stored), stored  # about 1/cp
    for r in stats.ranks:  # one all-gather per layer and step, and the token broadcasts
        assert r.collective_calls > 0 and r.collective_s > 0, r
    # steps with 16 prompt tokens (4 blocks of 4) split their prefill rows in stripes of
    # 4 over the ranks, and pass K/V round the ring (the only point-to-point traffic here)
    split = [r.split_prefill_tokens for r in stats.ranks]
    assert all(n > 0 for n in split) and max(split) < 1.25 * min(split), split
    assert sum(split) < sum(PROMPT_LENS) and all(r.p2p_bytes > 0 for r in stats.ranks)


def test_context_and_pipeline_parallel_equal_one_rank(llama):
    path, prompts, reference = llama
    outputs, stats = _run(path, prompts, context_parallel_size=2, pipeline_parallel_size=2)
    assert_same_outputs(reference, outputs, 1e-5)
    assert [r.rank for r in stats.ranks] == [0, 1, 2, 3]
    # ranks 0, 1: stage 0 (CP ranks 0, 1); ranks 2, 3: stage 1 - each stage stores the run's
    # KV once, split over its CP ranks; pipeline traffic on every rank
    stored = [r.kv_tokens_stored for r in stats.ranks]
    assert stored[0] + stored[1] == stored[2] + stored[3] == _kv_tokens(prompts)
    assert all(r.p2p_bytes > 0 for r in stats.ranks)


def test_tensor_and_context_parallel_equal_one_rank(llama):
    """TP 2 x CP 2: each CP group links the ranks holding the same KV heads."""
    path, prompts, reference = llama
    outputs, stats = _run(path, prompts, tensor_parallel_size=2, context_parallel_size=2)
    assert_same_outputs(reference, outputs, 1e-5)
    stored = [r.kv_tokens_stored for r in stats.ranks]  # ranks 0, 1: CP rank 0; 2, 3: 1
    assert stored[0] == stored[1] and stored[2] == stored[3]
    assert stored[0] + stored[2] == _kv_tokens(prompts)


def test_a_long_request_is_split_block_by_block(llama):
    """One request alone in a fresh pool takes block ids 0, 1, 2, ... in order (the core's
    free list): rank r stores exactly the positions of blocks r, r + 2, ..."""
    path, _, _ = llama
    prompt = _prompts(5)[0][:90]
    llm = LLM(str(path), **ENGINE, context_parallel_size=2)
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                              ignore_eos=True))
        stored = [r.kv_tokens_stored for r in llm.engine.stats().ranks]
        with pytest.raises(ValueError, match="not supported with context parallelism"):
            llm.generate([prompt], SamplingParams(max_tokens=2, streaming_kv=(4, 32)))
    finally:
        llm.engine.shutdown()
    positions = range(len(prompt) + MAX_NEW - 1)
    assert stored == [sum(1 for p in positions if (p // 4) % 2 == r) for r in range(2)]


def test_sliding_window_groups_equal_one_rank(tmp_path):
    """A tiny Qwen2 with a full and a sliding (window 12) layer: two KV cache groups, each
    table translated per rank; sliding blocks freed and reused as the window moves."""
    make_tiny_model("qwen2", tmp_path, use_sliding_window=True, sliding_window=12,
                    max_window_layers=1, num_hidden_layers=2, num_key_value_heads=2)
    prompts = _prompts(11)
    reference, _ = _run(tmp_path, prompts)
    outputs, _ = _run(tmp_path, prompts, context_parallel_size=2)
    assert_same_outputs(reference, outputs, 1e-5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(cache=CacheConfig(streaming_kv=(4, 32))), "streaming-kv"),
    (dict(speculative=SpeculativeConfig()), "speculative decoding runs on one rank"),
    (dict(distributed_executor_backend="uni"), "needs 'mp'"),
])
def test_what_context_parallelism_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(parallel=ParallelConfig(context_parallel_size=2), **kwargs)


def test_cli_flag_and_rank_layout():
    from heron.distributed.parallel_state import driver_rank, group_ranks
    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.engine_args import parallel_config

    par = parallel_config(build_parser().parse_args(["serve", "-cp", "2", "-pp", "2"]))
    assert (par.context_parallel_size, par.world_size, par.driver_rank) == (2, 4, 2)
    groups = group_ranks(tp=2, pp=2, cp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert driver_rank(tp=2, pp=2, cp=2) == 4
