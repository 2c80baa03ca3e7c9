"""Greedy outputs and logprobs equal HF transformers' (float32) for every architecture,
under chunked prefill, preemption and batches that mix prefill chunks with decodes."""

from __future__ import annotations

import pytest

from hf_reference import (TINY_CONFIGS, assert_matches_hf, hf_prompt_logprobs,
                          random_greedy_cases)
from heron import LLM, SamplingParams

MAX_NEW = 16
PROMPT_LENS = (5, 23, 41, 2, 64, 11)
SETTINGS = {
    # name: engine kwargs. block_size 4 x 24 blocks = 96 tokens < demand of 6 requests.
    "chunked+preempt": dict(max_num_batched_tokens=16, block_size=4, num_kv_blocks=24,
                            max_num_seqs=4),
    "large-budget": dict(max_num_batched_tokens=512, block_size=16, max_num_seqs=8),
    # the same through a worker process: every step crosses the boundary encoded
    "mp:chunked+preempt": dict(max_num_batched_tokens=16, block_size=4, num_kv_blocks=24,
                               max_num_seqs=4, distributed_executor_backend="mp"),
}
SLIDING_KV_BLOCKS = 12


pytestmark = pytest.mark.parametrize("tiny", sorted(TINY_CONFIGS), indirect=True)


@pytest.fixture(scope="module")
def cases(tiny):
    """Random prompts, seeded by the length of the architecture's name, and HF's greedy refs."""
    return random_greedy_cases(tiny.hf, PROMPT_LENS, MAX_NEW, len(tiny.hf.config.model_type))


def _record_mix(llm: LLM) -> list[tuple[int, int]]:
    """Wrap the scheduler to record (prefill chunks, decodes) of every step."""
    mixes: list[tuple[int, int]] = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        requests = llm.engine.scheduler.requests
        decodes = sum(1 for r, n in zip(out.req_ids, out.num_scheduled_tokens)
                      if n == 1 and requests[r].num_computed_tokens >= requests[r].num_prompt_tokens)
        mixes.append((len(out.req_ids) - decodes, decodes))
        return out

    llm.engine.scheduler.schedule = recording
    return mixes


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_and_logprobs_match_hf(tiny, cases, setting):
    path, (prompts, refs) = tiny.path, cases
    kwargs = dict(SETTINGS[setting])
    if getattr(tiny.hf.config, "sliding_window", None) and "num_kv_blocks" in kwargs:
        # sliding layers give back what leaves their window: fewer blocks force preemption
        kwargs["num_kv_blocks"] = SLIDING_KV_BLOCKS
    llm = LLM(str(path), **kwargs)
    mixes = _record_mix(llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    assert_matches_hf(llm.generate(prompts, params), refs)
    if setting.endswith("chunked+preempt"):
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert any(chunks and decodes for chunks, decodes in mixes), "no mixed step happened"
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_prompt_logprobs_match_hf(tiny, cases):
    path, hf, prompts = tiny.path, tiny.hf, cases[0]
    llm = LLM(str(path), max_num_batched_tokens=16, block_size=4)
    outputs = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=1,
                                                       prompt_logprobs=3))
    for prompt, out in zip(prompts, outputs):
        ref = hf_prompt_logprobs(hf, prompt)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for i, lp in enumerate(ref, start=1):
            entry = out.prompt_logprobs[i]
            assert entry[prompt[i]][0] == pytest.approx(lp, abs=1e-4)
            assert len(entry) in (3, 4)  # top-3 plus the prompt token if outside them
