"""Defence in depth inside the engine: a request whose processing raises (scheduler, worker,
sampler, outcome, detokenizer) is finished with finish_reason "error", its blocks freed; everyone else's
output is what it would have been without it. A failure no request explains stops the engine.
"""

from __future__ import annotations

import pytest

from hf_reference import make_tiny_model
from heron import LLM, SamplingParams
from heron.engine.isolation import EngineFault, run_isolating
from heron.engine.kv_cache import KVCacheManager
from heron.engine.output_processor import OutputProcessor
from heron.engine.scheduler import Scheduler
from heron.sample import processing, sampler as sampler_module

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 7, [20 + i for i in range(30)], [3, 1, 4, 1, 5]]
POISON = 77  # a prompt holding this token triggers the injected fault


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", path)
    # a small budget so prompts chunk and steps mix prefill with decode
    return LLM(str(path), max_model_len=128, max_num_batched_tokens=32, num_kv_blocks=64,
               block_size=4)


@pytest.fixture(scope="module")
def clean(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _run_with_poison(llm, params=GREEDY):
    """Generate PROMPTS plus one poisoned prompt in the same batches; returns its output
    and the others', after checking that every KV block is free again."""
    poisoned = [1, 2, POISON, 4]
    outs = llm.generate(PROMPTS[:2] + [poisoned] + PROMPTS[2:], params)
    engine = llm.engine
    assert not engine.core.sequences and not engine.output_processor.requests
    assert not engine.scheduler.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return outs[2], [o.outputs[0].token_ids for o in outs[:2] + outs[3:]]


def _raise_for_poison(original, requests_of):
    def wrapper(*args, **kwargs):
        if any(POISON in r.prompt_token_ids for r in requests_of(*args, **kwargs)):
            raise IndexError("index 1000000000 is out of bounds")  # as a bad id would
        return original(*args, **kwargs)
    return wrapper


def test_sampler_failure_fails_only_its_request(llm, clean, monkeypatch):
    monkeypatch.setattr(processing, "_mask_min_tokens", _raise_for_poison(
        processing._mask_min_tokens, lambda logits, requests: requests))
    bad, others = _run_with_poison(llm, SamplingParams(temperature=0, max_tokens=10,
                                                       ignore_eos=True, min_tokens=1))
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "IndexError" in bad.error
    assert others == clean


def test_stop_check_failure_fails_only_its_request(llm, clean, monkeypatch):
    original = Scheduler._append_token

    def append(self, req, token, now):
        if POISON in req.prompt_token_ids and req.num_output_tokens == 3:
            raise KeyError("a broken stop check")
        return original(self, req, token, now)

    monkeypatch.setattr(Scheduler, "_append_token", append)
    bad, others = _run_with_poison(llm)
    assert bad.outputs[0].finish_reason == "error" and len(bad.outputs[0].token_ids) == 3
    assert others == clean


def test_detokenizer_failure_fails_only_its_request(llm, clean, monkeypatch):
    """Output processing runs after the core's step: a failure there aborts the request in
    the core, which frees its blocks."""
    original = OutputProcessor._apply

    def apply(self, state, delta):
        if POISON in state.prompt_token_ids and len(state.sequences[0].token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return original(self, state, delta)

    monkeypatch.setattr(OutputProcessor, "_apply", apply)
    bad, others = _run_with_poison(llm)
    assert bad.outputs[0].finish_reason == "error" and "UnicodeDecodeError" in bad.error
    assert others == clean


def test_scheduler_failure_fails_only_its_request(llm, clean, monkeypatch):
    monkeypatch.setattr(KVCacheManager, "lookup", _raise_for_poison(
        KVCacheManager.lookup, lambda self, request: [request]))
    bad, others = _run_with_poison(llm)
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert others == clean


def test_n_siblings_fail_together(llm, clean, monkeypatch):
    monkeypatch.setattr(processing, "_mask_min_tokens", _raise_for_poison(
        processing._mask_min_tokens, lambda logits, requests: requests))
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=6, min_tokens=1)
    out = llm.generate([[1, POISON, 3]], params)[0]
    assert [c.finish_reason for c in out.outputs] == ["error"] * 3
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == clean


def test_a_failure_every_request_shares_is_an_engine_fault(llm, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sampler_module.Sampler, "__call__", broken)
    with pytest.raises(EngineFault, match="illegal memory access"):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    for request_id in list(llm.engine.core.sequences):  # a caller would restart; clean up
        llm.engine.abort_request(request_id)


@pytest.mark.parametrize("bad", [set(), {3}, {0, 7}, {1, 2, 5}, set(range(8))])
def test_bisection_finds_exactly_the_failing_items(bad):
    calls = []

    def run(items):
        calls.append(list(items))
        if bad & set(items):
            raise ValueError(f"bad among {items}")
        return list(items)

    results, failures = run_isolating(run, list(range(8)))
    assert sorted(i for part in results for i in part) == sorted(set(range(8)) - bad)
    assert sorted(item for item, _ in failures) == sorted(bad)
    assert len(calls) <= 1 + 2 * len(bad) * 3  # log2(8) levels per bad item
