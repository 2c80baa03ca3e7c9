"""With the prefix cache on, outputs stay token-exact with HF transformers (float32): hits that
end mid-prompt, a prompt that is a prefix of another, a multi-turn follow-up that reuses the
generated blocks, n > 1 siblings, and preemption of requests whose prefix is shared."""

from __future__ import annotations

import random

import pytest

from hf_reference import assert_matches_hf, hf_greedy, make_tiny_model
from heron import LLM, SamplingParams

MAX_NEW = 12
BLOCK = 4
SYSTEM_LEN = 37  # not a multiple of BLOCK: every hit ends mid-prompt, inside a block
QUESTION_LENS = (3, 9, 16, 1, 20)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-prefix")
    hf = make_tiny_model("llama", path)
    rng = random.Random(4)
    system = [rng.randrange(3, 512) for _ in range(SYSTEM_LEN)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(n)] for n in QUESTION_LENS]
    prompts += [system[:30], list(system)]  # prefixes of the others
    refs = [hf_greedy(hf, p, MAX_NEW, top_n=3) for p in prompts]
    return path, hf, prompts, refs


def _assert_all_blocks_available(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert all(c == 0 for c in kv.pool.ref_counts)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_warm_cache_hits_are_exact(shared, policy):
    path, _, prompts, refs = shared
    llm = LLM(str(path), block_size=BLOCK, max_num_batched_tokens=512,
              scheduling_policy=policy)
    assert_matches_hf(llm.generate(prompts[:1], GREEDY), refs[:1])
    outputs = llm.generate(prompts, GREEDY)
    assert_matches_hf(outputs, refs)
    cached = [out.num_cached_tokens for out in outputs]
    assert cached[0] == len(prompts[0]) - 1 - (len(prompts[0]) - 1) % BLOCK  # all but the tail
    assert all(c >= SYSTEM_LEN // BLOCK * BLOCK for c in cached[1:5])
    assert cached[5] == 28 and cached[6] == 36  # prefixes: capped to leave one token to compute
    stats = llm.engine.stats()
    assert stats.prefix_cache.hits >= sum(cached)
    _assert_all_blocks_available(llm)


def test_preempting_requests_that_share_a_prefix_is_exact(shared):
    path, _, prompts, refs = shared
    # 24 blocks x 4 tokens < what 7 requests need at once: preemptions while blocks are shared
    llm = LLM(str(path), block_size=BLOCK, num_kv_blocks=24, max_num_batched_tokens=16,
              max_num_seqs=4)
    outputs = llm.generate(prompts, GREEDY)
    assert_matches_hf(outputs, refs)
    stats = llm.engine.stats()
    assert stats.scheduler.num_preemptions > 0
    assert stats.prefix_cache.hits > 0
    _assert_all_blocks_available(llm)
    assert llm.reset_prefix_cache() == stats.num_cached_blocks > 0
    assert llm.engine.kv_cache.pool.num_free_blocks == llm.engine.kv_cache.num_blocks
    # an emptied cache keeps its counters (totals that only grow: /metrics counters)
    after = llm.engine.stats().prefix_cache
    assert (after.hits, after.queries) == (stats.prefix_cache.hits, stats.prefix_cache.queries)


def test_cache_off_gives_the_same_outputs_and_computes_every_token(shared):
    path, _, prompts, refs = shared
    llm = LLM(str(path), block_size=BLOCK, max_num_batched_tokens=512,
              enable_prefix_caching=False)
    llm.generate(prompts[:1], GREEDY)
    outputs = llm.generate(prompts, GREEDY)
    assert_matches_hf(outputs, refs)
    assert all(out.num_cached_tokens == 0 for out in outputs)
    stats = llm.engine.stats()
    assert stats.prefix_cache.hits == 0 and stats.num_cached_blocks == 0
    assert stats.scheduler.num_prefill_tokens == len(prompts[0]) + sum(len(p) for p in prompts)


def test_next_chat_turn_reuses_the_generated_blocks(shared):
    path, hf, prompts, refs = shared
    llm = LLM(str(path), block_size=BLOCK, max_num_batched_tokens=512)
    first = llm.generate(prompts[0], GREEDY)[0]
    turn2 = prompts[0] + first.outputs[0].token_ids + [5, 6, 7]
    out = llm.generate(turn2, GREEDY)[0]
    assert_matches_hf([out], [hf_greedy(hf, turn2, MAX_NEW, top_n=3)])
    # the cached KV reaches into the first turn's output, not just its prompt
    assert out.num_cached_tokens > len(prompts[0])


def test_parallel_samples_prefill_the_prompt_once(shared):
    path, _, prompts, refs = shared
    llm = LLM(str(path), block_size=BLOCK, max_num_batched_tokens=512)
    prompt, n = prompts[4], 4
    params = SamplingParams(n=n, temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    assert all(c.token_ids == refs[4][0] for c in out.outputs)
    # the first sibling computes the prompt; the others only the last partial block
    computed = llm.engine.stats().scheduler.num_prefill_tokens
    tail = len(prompt) - (len(prompt) - 1) // BLOCK * BLOCK
    assert computed == len(prompt) + (n - 1) * tail
    _assert_all_blocks_available(llm)


def test_cache_salt_isolates_tenants(shared):
    path, _, prompts, _ = shared
    llm = LLM(str(path), block_size=BLOCK, max_num_batched_tokens=512)
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=2)

    def run(salt):
        engine.add_request(engine.new_request_id(), prompts[0], params, cache_salt=salt)
        return [o for step in iter(engine.step, []) for o in step if o.finished][0]

    assert run("tenant-a").num_cached_tokens == 0
    assert run("tenant-b").num_cached_tokens == 0  # same prompt, other tenant: no hit
    assert run("tenant-a").num_cached_tokens > 0
    assert run(None).num_cached_tokens == 0
