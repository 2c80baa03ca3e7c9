"""AsyncEngineClient (engine core in its own process) against the offline LLM.

Same outputs (greedy, seeded n=2, stops, logprobs, text), 32 concurrent requests, aborts that
free every KV block, rejected requests, a core killed mid-request, a core that fails to start.
Every wait is bounded: ``_run`` puts a wall-clock limit on each coroutine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from heron import LLM, SamplingParams
from heron.config import CacheConfig, EngineConfig, SchedulerConfig
from heron.engine.core_outputs import RequestOutputKind
from heron.outputs import OutputAccumulator
from heron.server.metrics import ServerMetrics
from heron.transport.async_client import AsyncEngineClient, EngineDeadError

TINY = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _config(model, max_model_len, max_num_batched_tokens, max_num_seqs, num_kv_blocks=None):
    return EngineConfig(model=model, max_model_len=max_model_len,
                        cache=CacheConfig(num_blocks=num_kv_blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens, max_num_seqs))


def _run(loop, coro, timeout=60):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    return LLM(str(tiny.path), **TINY)


@pytest.fixture(scope="module")
def tiny_client(loop, tiny):
    client = _run(loop, AsyncEngineClient.start(_config(str(tiny.path), **TINY)))
    yield client
    _run(loop, client.shutdown())


async def _collect(client, request_id, prompt, params):
    """Every delta output yielded for one request, then (last) their fold: the cumulative
    output. Checks that a finished completion never reappears."""
    outs, acc, done = [], OutputAccumulator(), set()
    async for out in client.generate(request_id, prompt, params):
        assert out.outputs and len({c.index for c in out.outputs}) == len(out.outputs)
        for c in out.outputs:
            assert c.index not in done
            if c.finished:
                done.add(c.index)
        outs.append(out)
        acc.add(out)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert done == set(range(params.n))
    return outs + [acc.output()]


async def _collect_all(client, prompts, params, prefix="r"):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return await asyncio.gather(*(_collect(client, f"{prefix}{i}", p, sp)
                                  for i, (p, sp) in enumerate(zip(prompts, params))))


def _assert_logprobs_close(a, b):
    assert (a is None) == (b is None)
    for pa, pb in zip(a or [], b or []):
        assert (pa is None) == (pb is None)
        assert set(pa or {}) == set(pb or {})
        for tok in pa or {}:
            assert pa[tok][0] == pytest.approx(pb[tok][0], abs=1e-4)


def _assert_same(got, want):
    assert got.prompt_token_ids == want.prompt_token_ids
    assert len(got.outputs) == len(want.outputs)
    for g, w in zip(got.outputs, want.outputs):
        assert (g.index, g.token_ids, g.text) == (w.index, w.token_ids, w.text)
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
        _assert_logprobs_close(g.logprobs, w.logprobs)
    _assert_logprobs_close(got.prompt_logprobs, want.prompt_logprobs)


async def _wait_for_stats(client, predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate(client.stats()):
        assert time.monotonic() < deadline, f"stats never settled: {client.stats()}"
        await asyncio.sleep(0.05)


def test_outputs_equal_offline(loop, tiny_client, tiny_llm):
    prompts = [[5, 6, 7, 8], list(range(10, 110)), [300, 200, 100]]  # 100 tokens: chunked
    ref = tiny_llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=20))[0]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2,
                             ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20,
                             stop_token_ids=[ref.outputs[0].token_ids[5]])]
    want = tiny_llm.generate(prompts, params)
    streams = _run(loop, _collect_all(tiny_client, prompts, params))
    for outs, w in zip(streams, want):
        _assert_same(outs[-1], w)
    assert len(streams[0]) > 2  # streamed, not delivered all at once
    assert streams[2][-1].outputs[0].stop_reason == ref.outputs[0].token_ids[5]
    assert tiny_client.vocab_size == 512 and tiny_client.max_model_len == 256


def test_cumulative_and_final_only_kinds(loop, tiny_client, tiny_llm):
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=10, logprobs=2,
                            prompt_logprobs=1, ignore_eos=True)
    want = tiny_llm.generate([[7, 8, 9]], params)[0]

    async def body(kind):
        return [out async for out in tiny_client.generate(f"kind-{kind.value}", [7, 8, 9],
                                                          params, output_kind=kind)]

    cumulative = _run(loop, body(RequestOutputKind.CUMULATIVE))
    assert len(cumulative) > 1 and not any(o.finished for o in cumulative[:-1])
    for prev, cur in zip(cumulative, cumulative[1:]):  # each extends the one before
        assert [c.index for c in cur.outputs] == [0, 1]
        for p, c in zip(prev.outputs, cur.outputs):
            assert c.token_ids[:len(p.token_ids)] == p.token_ids and c.text.startswith(p.text)
    assert all(o.prompt_logprobs is not None for o in cumulative)
    _assert_same(cumulative[-1], want)
    final_only = _run(loop, body(RequestOutputKind.FINAL_ONLY))
    assert len(final_only) == 1 and final_only[0].finished
    _assert_same(final_only[0], want)


def test_32_concurrent_requests(loop, tiny_client, tiny_llm):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(3 + (i * 5) % 60)] for i in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=4 + i % 37, ignore_eos=True)
              for i in range(32)]
    want = tiny_llm.generate(prompts, params)
    streams = _run(loop, _collect_all(tiny_client, prompts, params, prefix="c"))
    for outs, w in zip(streams, want):
        _assert_same(outs[-1], w)


def test_abort_frees_all_blocks(loop, tiny_client):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def consume(gen):
        async for _ in gen:
            pass

    async def body():
        before = tiny_client.stats().num_generation_tokens_total
        gens = [tiny_client.generate(f"ab{i}", [9 + i] * 20, long) for i in range(4)]
        for gen in gens:  # two outputs each, then close: the client disconnected
            await anext(gen)
            await anext(gen)
        for gen in gens:
            await gen.aclose()
        task = asyncio.create_task(consume(tiny_client.generate("ab-cancel", [3] * 30, long)))
        await asyncio.sleep(0.1)
        task.cancel()
        gen = tiny_client.generate("ab-explicit", [4] * 10, long)
        await anext(gen)
        await tiny_client.abort("ab-explicit")
        rest = [out async for out in gen]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        await _wait_for_stats(tiny_client, lambda s: s.num_free_blocks == s.num_blocks
                              and s.num_running == 0 and s.num_waiting == 0
                              and s.num_unfinished_requests == 0)
        generated = tiny_client.stats().num_generation_tokens_total - before
        assert generated < 2 * 200  # the six aborted requests stopped early (1200 if not)

    _run(loop, body())


def test_bad_requests_are_rejected_and_serving_continues(loop, tiny_client, tiny_llm):
    async def body():
        for prompt, match in (([], "empty"), ([5] * 300, "max_model_len"),
                              ([100_000], "vocabulary")):
            with pytest.raises(ValueError, match=match):
                await _collect(tiny_client, f"bad-{match}", prompt, GREEDY)
        gen = tiny_client.generate("dup", [5, 6], GREEDY)
        await anext(gen)
        with pytest.raises(ValueError, match="duplicate"):
            await anext(tiny_client.generate("dup", [5, 6], GREEDY))
        await gen.aclose()
        return await _collect(tiny_client, "good", [5, 6, 7], GREEDY)

    outs = _run(loop, body())
    _assert_same(outs[-1], tiny_llm.generate([[5, 6, 7]], GREEDY)[0])
    assert tiny_client.stats().num_requests_rejected_total >= 3
    assert tiny_client.is_alive()


def test_engine_stats_arrive_typed_and_feed_the_metrics(loop, tiny_client):
    """The core's EngineStats cross typed; its histograms grow with the steps, and the
    server's /metrics renders them."""
    before = tiny_client.stats()
    prompt = [5, 6, 7, 8]
    _run(loop, _collect(tiny_client, "stats-flow", prompt, GREEDY))
    after = tiny_client.stats()
    steps = after.step_time.count - before.step_time.count
    assert steps >= GREEDY.max_tokens  # one prefill and a decode per further token, at least
    tokens = after.scheduler.step_tokens
    assert tokens.count - before.scheduler.step_tokens.count == steps
    assert tokens.sum - before.scheduler.step_tokens.sum == len(prompt) + GREEDY.max_tokens - 1
    assert after.scheduler.queue_time.count == before.scheduler.queue_time.count + 1
    metrics = ServerMetrics()
    metrics.update_engine_stats(after)
    rendered = {s.name: s.value for fam in text_string_to_metric_families(
        metrics.render()[0].decode()) for s in fam.samples if "le" not in s.labels}
    assert rendered["heron:engine_step_time_seconds_count"] == after.step_time.count
    assert rendered["heron:iteration_tokens_total_sum"] == tokens.sum
    assert rendered["heron:request_queue_time_seconds_count"] == after.scheduler.queue_time.count
    assert after.ranks == []  # the in-process worker reports no ranks


def test_killed_core_raises_engine_dead_error(loop, tiny):
    client = _run(loop, AsyncEngineClient.start(_config(str(tiny.path), **TINY)))
    long = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)

    async def body():
        gen = client.generate("victim", [5] * 10, long)
        await anext(gen)
        os.kill(client.pid, signal.SIGKILL)
        # noticed from the process's exit, not from the heartbeat timeout
        with pytest.raises(EngineDeadError, match=r"died \(exit code -9\)"):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await anext(client.generate("after", [5], GREEDY))

    try:
        _run(loop, body())
        assert not client.is_alive()
    finally:
        _run(loop, client.shutdown())


def test_startup_failure_raises_runtime_error(loop):
    with pytest.raises(RuntimeError, match="not found"):
        _run(loop, AsyncEngineClient.start(EngineConfig(model="/nonexistent/model")))


def test_text_equals_offline_on_smollm2(loop, smollm2):
    question = smollm2.apply_chat_template([{"role": "user",
                                             "content": "What is the capital of France?"}])
    poem = smollm2.apply_chat_template([{"role": "user",
                                         "content": "Write a short poem about the sea."}])
    prompts = [question, question, poem]
    params = [SamplingParams(temperature=0, max_tokens=32),
              SamplingParams(temperature=0, max_tokens=32, stop=["al of Fr", "zzz"]),
              SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16, logprobs=2)]
    want = smollm2.generate(prompts, params)
    client = _run(loop, AsyncEngineClient.start(_config(None, 2048, 256, 32)))
    try:
        streams = _run(loop, _collect_all(client, prompts, params, prefix="s"))
        assert client.model_name == smollm2.engine.model_name
        assert client.tokenizer.decode(want[0].outputs[0].token_ids,
                                       skip_special_tokens=True) == want[0].outputs[0].text
    finally:
        _run(loop, client.shutdown())
    for outs, w in zip(streams, want):
        _assert_same(outs[-1], w)
    assert streams[1][-1].outputs[0].text == "The capit"  # no held-back text leaked
