"""Unit tests of the server's pure pieces: protocol models, metrics, admission control."""

from __future__ import annotations

import json
import math

import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from heron.engine.stats import EngineStats, SchedulerStats
from heron.server.admission import AdmissionController, Overloaded
from heron.server.errors import RequestValidationError, error_body, pydantic_error_message
from heron.server.metrics import ServerMetrics, cost_per_million_tokens
from heron.server.protocol import (ChatCompletionRequest, CompletionRequest, parse_request,
                                   validate_limits)
from heron.server.responses import ChatCompletionResponse, ErrorResponse, Usage


def completion(**kw):
    return CompletionRequest(**{"model": "m", "prompt": "hi", **kw})


def chat(**kw):
    return ChatCompletionRequest(**{"model": "m",
                                    "messages": [{"role": "user", "content": "hi"}], **kw})


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- protocol

@pytest.mark.parametrize("prompt,expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_shapes(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [
    "", [], [[]], [""], [1, "a"], [1.5, 2], [True], {"a": 1}, [[1], ["a"]], [-1, 2], None,
])
def test_completion_bad_prompts(prompt):
    with pytest.raises(pydantic.ValidationError) as err:
        completion(prompt=prompt)
    message, param = pydantic_error_message(err.value.errors())
    assert param == "prompt" and message


def test_chat_messages_and_content_parts():
    req = chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ])
    assert req.conversation() == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "a\nb"},
                                  {"role": "assistant", "content": ""}]
    for bad in ([], [{"role": "wizard", "content": "x"}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]):
        with pytest.raises(pydantic.ValidationError):
            chat(messages=bad)


def test_completion_to_sampling_params_defaults_and_extras():
    p = completion().to_sampling_params(default_max_tokens=100)
    assert (p.temperature, p.top_p, p.n, p.max_tokens, p.logprobs) == (1.0, 1.0, 1, 16, None)
    p = completion(max_tokens=None, temperature=0, top_p=0.9, n=3, stop="x", seed=7,
                   presence_penalty=0.5, frequency_penalty=-0.5, top_k=40, min_p=0.05,
                   repetition_penalty=1.1, min_tokens=2, ignore_eos=True, stop_token_ids=[5],
                   logprobs=3, echo=True).to_sampling_params(default_max_tokens=100)
    assert p.max_tokens == 100 and p.greedy and p.top_p == 0.9 and p.n == 3
    assert p.stop == ["x"] and p.seed == 7 and p.top_k == 40 and p.min_p == 0.05
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.min_tokens == 2 and p.ignore_eos and p.stop_token_ids == [5]
    assert p.logprobs == 3 and p.prompt_logprobs == 3
    assert completion(logprobs=2).to_sampling_params(10).prompt_logprobs is None


def test_chat_to_sampling_params_mapping():
    p = chat().to_sampling_params(default_max_tokens=123)
    assert p.max_tokens == 123 and p.logprobs is None and p.temperature == 1.0
    assert chat(max_tokens=5).to_sampling_params(123).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params(123).max_tokens == 9
    assert chat(logprobs=True).to_sampling_params(10).logprobs == 0
    assert chat(n=None, seed=-1).to_sampling_params(10).n == 1
    assert chat(logprobs=True, top_logprobs=20).to_sampling_params(10).logprobs == 20


def _parse(cls, **fields):
    return parse_request(cls, json.dumps(fields).encode())


def completion_body(**kw):
    return _parse(CompletionRequest, **{"model": "m", "prompt": "hi", **kw})


def chat_body(**kw):
    return _parse(ChatCompletionRequest,
                  **{"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize("make,param", [
    (lambda: completion_body(top_p=1.5), "top_p"),
    (lambda: completion_body(n=0), "n"),
    (lambda: completion_body(n=10_000), "n"),
    (lambda: completion_body(seed=2**64), "seed"),
    (lambda: completion_body(top_k=2**64), "top_k"),
    (lambda: completion_body(min_tokens=2**70), "min_tokens"),
    (lambda: completion_body(stop_token_ids=[2**70]), "stop_token_ids"),
    (lambda: completion_body(stop_token_ids=[-1]), "stop_token_ids"),
    (lambda: completion_body(prompt=[2**70]), "prompt"),
    (lambda: completion_body(logprobs=21), "logprobs"),  # engine cap (--max-logprobs lowers it)
    (lambda: completion_body(stop=[f"s{i}" for i in range(20)]), "stop"),
    (lambda: completion_body(stop=[""]), "stop"),
    (lambda: completion_body(max_tokens=0), "max_tokens"),
    (lambda: completion_body(max_tokens=1.0), "max_tokens"),
    (lambda: completion_body(n="2"), "n"),
    (lambda: completion_body(n=True), "n"),
    (lambda: completion_body(stream="yes"), "stream"),
    (lambda: completion_body(temperature=-1), "temperature"),
    (lambda: completion_body(repetition_penalty=0), "repetition_penalty"),
    (lambda: completion_body(repetition_penalty=2.5), "repetition_penalty"),
    (lambda: completion_body(min_tokens=5, max_tokens=2), "min_tokens"),
    (lambda: completion_body(stream_options={"include_usage": True}), "stream_options"),
    (lambda: completion_body(logit_bias={"1": 5}), "logit_bias"),
    (lambda: completion_body(response_format={"type": "json_object"}), "response_format"),
    (lambda: completion_body(best_of=3), "best_of"),
    (lambda: chat_body(top_logprobs=21, logprobs=True), "top_logprobs"),
    (lambda: chat_body(top_logprobs=2), "logprobs"),
    (lambda: chat_body(presence_penalty=3), "presence_penalty"),
    (lambda: chat_body(max_completion_tokens=0), "max_completion_tokens"),
    (lambda: chat_body(tools=[{"type": "function"}]), "tools"),
])
def test_validation_errors(make, param):
    with pytest.raises(RequestValidationError) as err:
        make().to_sampling_params(default_max_tokens=16)
    assert err.value.param == param and err.value.status_code == 400
    body = err.value.to_body()
    assert ErrorResponse(**body).error.type == "invalid_request_error"
    assert body["error"]["message"] == str(err.value)


@pytest.mark.parametrize("raw", [
    b'{"prompt": "Hi \\ud800"}', b'{"prompt": "\xff"}', b"[" * 5000 + b"]" * 5000,
    b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x"', b"", b"[]",
])
def test_malformed_bodies_are_400_without_an_offset_param(raw):
    with pytest.raises(RequestValidationError) as err:
        parse_request(CompletionRequest, raw)
    assert err.value.param in (None, "temperature") and err.value.message


def test_defaults_are_accepted_for_unsupported_fields():
    req = completion_body(response_format={"type": "text"}, best_of=1, tools=[],
                          use_beam_search=False)
    assert req.to_sampling_params(16).n == 1
    assert chat_body(n=2, best_of=2).to_sampling_params(16).n == 2


def test_validate_limits_configurable_and_extras_ignored():
    req = completion(stop=["a", "b", "c"], some_future_field=1)
    validate_limits(req)
    with pytest.raises(RequestValidationError, match="at most 2 stop strings"):
        validate_limits(req, max_stop_strings=2)
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage


def test_response_models_and_error_body():
    resp = ChatCompletionResponse(model="m", usage=Usage.of(3, 4), choices=[
        {"index": 0, "message": {"content": "hi"}, "finish_reason": "stop",
         "logprobs": {"content": [{"token": "hi", "logprob": -0.1, "bytes": [104, 105],
                                   "top_logprobs": [{"token": "hi", "logprob": -0.1}]}]}}])
    data = resp.model_dump()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["usage"]["total_tokens"] == 7 and data["choices"][0]["message"]["role"] == \
        "assistant"
    assert error_body("boom", param="n") == {"error": {
        "message": "boom", "type": "invalid_request_error", "param": "n", "code": None}}


# ---------------------------------------------------------------- metrics

def samples(metrics: ServerMetrics) -> dict:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_render_and_counters_move():
    m = ServerMetrics()
    before = samples(m)
    assert before[("heron:num_requests_running", ())] == 0
    m.observe_request_finished(prompt_tokens=10, completion_tokens=4, arrival=0.0,
                               first_token=0.5, finish=1.1, queue_time=0.2,
                               finish_reason="length", token_times=[0.5, 0.7, 0.9, 1.1])
    engine = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25,
                         num_prompt_tokens_total=10, num_generation_tokens_total=1,
                         scheduler=SchedulerStats(num_preemptions=2))
    m.update_engine_stats(engine)
    engine.scheduler.num_preemptions, engine.num_generation_tokens_total = 5, 4
    engine.scheduler.queue_time.observe(0.2)  # the engine observes queue time
    m.update_engine_stats(engine)
    m.record_rejection(429)
    s = samples(m)
    assert s[("heron:prompt_tokens_total", ())] == 10
    assert s[("heron:generation_tokens_total", ())] == 4
    assert s[("heron:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("heron:request_rejected_total", (("cause", "429"),))] == 1
    assert s[("heron:num_preemptions_total", ())] == 5
    assert (s[("heron:num_requests_running", ())], s[("heron:num_requests_waiting", ())]) == (3, 2)
    assert s[("heron:kv_cache_usage_perc", ())] == 0.25
    assert s[("heron:time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    assert s[("heron:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.1)
    assert s[("heron:inter_token_latency_seconds_count", ())] == 3
    assert s[("heron:time_per_output_token_seconds_sum", ())] == pytest.approx(0.2)
    assert s[("heron:request_prefill_time_seconds_sum", ())] == pytest.approx(0.3)
    assert s[("heron:request_decode_time_seconds_sum", ())] == pytest.approx(0.6)
    assert s[("heron:request_queue_time_seconds_sum", ())] == pytest.approx(0.2)
    assert ("heron:cost_per_million_tokens_dollars", (("kind", "generation"),)) not in s
    assert samples(ServerMetrics()).get(("heron:prompt_tokens_total", ())) == 0  # own registry


def test_cost_gauge_arithmetic():
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # 3.6e6 tok/h at $3.6
    assert math.isnan(cost_per_million_tokens(2.0, 0.0))
    clock = FakeClock(0.0)
    m = ServerMetrics(cost_per_gpu_hour=7.2, throughput_window_s=60.0, clock=clock)
    clock.t = 100.0
    m.record_tokens(generation_tokens=60_000, prompt_tokens=60_000)  # 1000 / 2000 tok/s
    s = samples(m)
    assert s[("heron:cost_per_million_tokens_dollars", (("kind", "generation"),))] == \
        pytest.approx(2.0)
    assert s[("heron:cost_per_million_tokens_dollars", (("kind", "total"),))] == \
        pytest.approx(1.0)
    clock.t = 200.0  # the window has emptied: no throughput, cost undefined
    assert math.isnan(samples(m)[("heron:cost_per_million_tokens_dollars",
                                  (("kind", "generation"),))])
    young = ServerMetrics(cost_per_gpu_hour=3.6, clock=FakeClock(0.0))
    young._clock.t = 10.0  # 10 s of uptime: rate over 10 s, not the 60 s window
    young.record_tokens(10_000)
    assert young.throughput() == (1000.0, 1000.0)
    newborn = ServerMetrics(cost_per_gpu_hour=3.6, clock=FakeClock(0.0))
    newborn._clock.t = 0.001  # a burst in the first millisecond: rate over 1 s, not 1 ms
    newborn.record_tokens(1000)
    assert newborn.throughput() == (1000.0, 1000.0)
    body, content_type = m.render(accept="application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


# ---------------------------------------------------------------- admission

def test_admission_limits_and_release():
    ac = AdmissionController(max_queued_requests=2, max_queued_tokens=100, clock=FakeClock())
    ac.try_admit(40)
    ac.try_admit(40)
    with pytest.raises(Overloaded, match="2 requests queued") as err:
        ac.try_admit(1)
    assert err.value.retry_after_seconds == 1  # nothing drained yet
    ac.release(40)
    with pytest.raises(Overloaded, match="prompt tokens queued"):
        ac.try_admit(61)
    ac.try_admit(60)
    assert (ac.queued_requests, ac.queued_tokens) == (2, 100)
    ac.release(40)
    ac.release(60)
    ac.try_admit(5000)  # an empty queue always admits, however long the prompt
    with pytest.raises(RuntimeError):
        AdmissionController().release(1)


def test_admission_handles_release_once():
    ac = AdmissionController(max_queued_requests=1)
    with ac.admitted(10) as handle:
        assert ac.queued_requests == 1
        handle.release()  # e.g. client disconnect raced with completion
    assert ac.queued_requests == 0 and ac.queued_tokens == 0
    unlimited = AdmissionController(0, 0)
    for _ in range(1000):
        unlimited.try_admit(10**6)


@pytest.mark.parametrize("interval,expected", [(4.0, (4, 5)), (0.5, (1,)), (30.0, (30, 36)),
                                               (200.0, (60,))])
def test_retry_after_follows_drain_rate(interval, expected):
    clock = FakeClock()
    ac = AdmissionController(max_queued_requests=4, clock=clock)
    for _ in range(4):
        ac.try_admit(10)
    for _ in range(200):  # steady state: one request finishes and one arrives per interval
        clock.t += interval
        ac.release(10)
        ac.try_admit(10)
    clock.t += interval / 2  # mid-interval, as a real arrival would be
    req_rate, tok_rate = ac.drain_rate()
    if interval <= 30:  # a 10 s half-life cannot resolve rarer events precisely
        assert req_rate == pytest.approx(1 / interval, rel=0.2)
        assert tok_rate == pytest.approx(10 / interval, rel=0.2)
    with pytest.raises(Overloaded) as err:
        ac.try_admit(10)
    retry = err.value.retry_after_seconds
    assert expected[0] <= retry <= expected[-1]


def test_retry_after_ignores_idle_time_and_scales_with_excess():
    clock = FakeClock()
    ac = AdmissionController(max_queued_requests=10, max_queued_tokens=1000, clock=clock)
    for _ in range(20):  # 1 request / 100 tokens per second while busy
        ac.try_admit(100)
        clock.t += 1.0
        ac.release(100)
    clock.t += 3600.0  # an idle hour changes nothing
    assert ac.drain_rate()[0] == pytest.approx(1.0, rel=0.1)
    assert ac.retry_after(excess_requests=5) in (5, 6)
    assert ac.retry_after(excess_requests=0, excess_tokens=1000) in (10, 11)
    assert ac.retry_after(excess_requests=10_000) == 60
