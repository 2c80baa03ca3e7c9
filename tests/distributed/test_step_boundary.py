"""The step boundary between the engine core and its workers: the worker side imports nothing
from the core, the step result survives msgpack, and the multiprocess executor gives the
same outputs as the in-process one, isolates a failing request, and turns a dead worker into
an engine fault."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgspec
import pytest

from hf_reference import hf_greedy
from heron import LLM, SamplingParams
from heron.errors import EngineFault
from heron.worker.step import ModelRunnerOutput

WORKER_MODULES = ["heron.worker.worker", "heron.worker.model_runner", "heron.worker.input_batch",
                  "heron.worker.sampling_strategies", "heron.worker.step",
                  "heron.worker.cuda_graphs", "heron.executor.uniproc", "heron.executor.multiproc",
                  "heron.executor.worker_process", "heron.sample.sampler",
                  "heron.speculative.interface", "heron.speculative.factory",
                  "heron.speculative.drafter", "heron.speculative.ngram",
                  "heron.speculative.draft_models", "heron.speculative.tree",
                  "heron.speculative.verify_chain", "heron.speculative.verify_tree",
                  "heron.speculative.eagle_checkpoint", "heron.speculative.stats"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
POISON = 77


def test_the_worker_side_imports_nothing_from_the_core_or_above():
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in WORKER_MODULES)
            + "print([m for m in sys.modules if m.split('.')[:2] in "
              "(['heron', 'engine'], ['heron', 'transport'], ['heron', 'server'], "
              "['heron', 'entrypoints'])])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_runner_output_round_trips_through_msgpack():
    out = ModelRunnerOutput(["a", "b#1", "c"], [[5], [], [7, 8]],
                            [[{5: (-0.25, 1), 9: (-1.5, 2)}], None, None],
                            {"b#1": [{3: (-2.0, 4)}, {4: (-0.5, 1)}]})
    data = msgspec.msgpack.encode(out)
    assert msgspec.msgpack.decode(data, type=ModelRunnerOutput) == out


PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 7, [20 + i for i in range(30)], [3, 1, 4]]


@pytest.fixture(scope="module")
def refs(tiny):
    """HF's first 8 greedy tokens for each of PROMPTS on the tiny Llama."""
    return [hf_greedy(tiny.hf, p, 8)[0] for p in PROMPTS]


def _mp_llm(path) -> LLM:
    # small pool and budget: chunked prefill, mixed steps and preemption cross the boundary
    return LLM(str(path), max_model_len=64, max_num_batched_tokens=16, num_kv_blocks=20,
               block_size=4, max_num_seqs=4, distributed_executor_backend="mp")


def test_multiprocess_executor_is_hf_exact_with_prefix_hits(tiny, refs):
    path, prompts = tiny.path, PROMPTS
    llm = _mp_llm(path)
    try:
        for _ in range(2):  # the second round hits the prefix cache
            outs = llm.generate(prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == refs
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert llm.engine.kv_cache.prefix_cache.stats.hits > 0
        seeded = SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=6)
        in_process = LLM(str(path), max_model_len=128, block_size=4)
        assert [c.token_ids for c in llm.generate([prompts[1]], seeded)[0].outputs] == \
            [c.token_ids for c in in_process.generate([prompts[1]], seeded)[0].outputs]
    finally:
        llm.engine.shutdown()


def test_a_request_failing_in_the_worker_process_fails_alone(tiny, refs, monkeypatch):
    path, prompts = tiny.path, PROMPTS
    monkeypatch.setenv("HERON_FAULT_INJECTION_TOKEN", str(POISON))  # the worker inherits it
    llm = _mp_llm(path)
    try:
        outs = llm.generate(prompts[:2] + [[1, POISON, 2]] + prompts[2:], GREEDY)
        bad = outs.pop(2)
        assert bad.outputs[0].finish_reason == "error" and "injected fault" in bad.error
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    finally:
        llm.engine.shutdown()


def test_a_dead_worker_is_an_engine_fault(tiny):
    path, prompts = tiny.path, PROMPTS
    llm = _mp_llm(path)
    try:
        llm.generate(prompts[:1], GREEDY)
        os.kill(llm.engine.core.executor.pid, signal.SIGKILL)
        with pytest.raises(EngineFault, match="worker rank 0 exited"):
            llm.generate(prompts, GREEDY)
    finally:
        llm.engine.shutdown()
