"""KV cache groups on real model runs: sliding layers give back the blocks that leave their
window (memory per request bounded by the window), and outputs stay HF-exact (HF's own
sliding-window attention is the oracle), for a model whose layers are all sliding and for
one that mixes full and sliding layers (two groups sharing one pool)."""

from __future__ import annotations

import pytest

from hf_reference import assert_matches_hf, hf_greedy, make_tiny_model, random_greedy_cases
from heron import LLM, SamplingParams
from heron.models.kv_cache_spec import cdiv


def _track_sliding_blocks(llm: LLM) -> dict[str, int]:
    """Wrap the scheduler: after every step, the most blocks any request held in a sliding
    group, per request id."""
    sched, kv = llm.engine.scheduler, llm.engine.kv_cache
    most: dict[str, int] = {}
    update = sched.update_from_output

    def recording(out, result):
        for req_id in out.req_ids:
            request = sched.requests.get(req_id)
            if request is None:
                continue
            for group, table in zip(kv.groups, request.tables):
                if group.is_sliding:
                    most[req_id] = max(most.get(req_id, 0), len(table.owned()))
        return update(out, result)

    sched.update_from_output = recording
    return most


@pytest.fixture(scope="module")
def long_sliding(tmp_path_factory):
    """A tiny Mistral whose every layer slides over 256 positions, trained length 4,608."""
    path = tmp_path_factory.mktemp("tiny-mistral-256")
    hf = make_tiny_model("mistral", path, sliding_window=256, max_position_embeddings=4608)
    return path, hf


def test_a_4000_token_generation_holds_the_window_only(long_sliding):
    path, hf = long_sliding
    prompt = list(range(3, 40))
    llm = LLM(str(path), block_size=16, max_num_batched_tokens=64)
    most = _track_sliding_blocks(llm)
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert len(out.token_ids) == 4000
    assert max(most.values()) <= cdiv(256, 16) + 1
    ref_tokens, _ = hf_greedy(hf, prompt, 4000)
    assert out.token_ids == ref_tokens
    kv = llm.engine.kv_cache
    kv.reset_prefix_cache()
    assert kv.pool.num_free_blocks == kv.num_blocks  # nothing leaked


MIXED_LENS = (5, 23, 41, 70, 11, 96)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A tiny Qwen2 with one full-attention layer and one sliding layer (window 12)."""
    path = tmp_path_factory.mktemp("tiny-qwen2-mixed")
    hf = make_tiny_model("qwen2", path, use_sliding_window=True, sliding_window=12,
                         max_window_layers=1, num_hidden_layers=2)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    return path, hf, random_greedy_cases(hf, MIXED_LENS, 24, seed=7)


SETTINGS = {
    "chunked+preempt": dict(max_num_batched_tokens=16, block_size=4, num_kv_blocks=48,
                            max_num_seqs=4),
    "large-budget": dict(max_num_batched_tokens=512, block_size=16, max_num_seqs=8),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_full_and_sliding_groups_match_hf(mixed, setting):
    path, _, (prompts, refs) = mixed
    llm = LLM(str(path), **SETTINGS[setting])
    kv = llm.engine.kv_cache
    assert [g.sliding_window for g in kv.groups] == [None, 12]
    most = _track_sliding_blocks(llm)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    assert_matches_hf(llm.generate(prompts, params), refs)
    chunk, bs = llm.engine.config.scheduler.max_num_batched_tokens, kv.block_size
    assert max(most.values()) <= cdiv(12 - 1 + chunk, bs) + 1
    if setting == "chunked+preempt":
        assert llm.engine.scheduler.stats.num_preemptions > 0
    kv.reset_prefix_cache()
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_prefix_hits_reuse_both_groups(mixed):
    """A second round of the same prompts hits the cache in both groups (the sliding group
    only the blocks its window needs) and gives the same tokens."""
    path, _, (prompts, refs) = mixed
    llm = LLM(str(path), max_num_batched_tokens=32, block_size=4, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)
    stats = llm.engine.stats().prefix_cache
    assert stats.hits > 0
    for a, b, (ref_tokens, _) in zip(first, second, refs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref_tokens
