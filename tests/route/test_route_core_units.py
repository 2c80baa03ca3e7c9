"""The router's parts on their own: circuit breaker, admission queue, input guards, the
/metrics scrape, config and the worker registry. No server, no model."""

from __future__ import annotations

import asyncio

import pytest

from heron.route.admission import Admission, Refused, saturation_refusal
from heron.route.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from heron.route.config import RouterConfig
from heron.route.guards import route_request
from heron.route.health import parse_metrics
from heron.route.workers import WorkerRegistry, normalize_url, read_worker_file


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_half_opens_with_one_probe_and_closes():
    clock, moves = Clock(), []
    b = CircuitBreaker(3, 2, 10.0, on_transition=lambda o, n: moves.append((o, n)),
                       clock=clock)
    for _ in range(2):
        assert b.acquire()
        b.record_failure()
    b.record_success()  # a success resets the consecutive count
    for _ in range(3):
        b.record_failure()
    assert b.state == OPEN and not b.available() and b.retry_after_s() == 10.0
    clock.now = 10.0
    assert b.state == HALF_OPEN
    assert b.acquire() and not b.available()  # one probe at a time
    b.record_success()
    assert b.acquire()
    b.record_failure()  # a failed probe opens it again
    assert b.state == OPEN
    clock.now = 20.0
    for _ in range(2):
        assert b.acquire()
        b.record_success()
    assert b.state == CLOSED
    assert moves == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (OPEN, HALF_OPEN),
                     (HALF_OPEN, CLOSED)]
    off = CircuitBreaker(1, enabled=False)
    off.record_failure()
    assert off.available()


def test_admission_queue_full_429_and_timeout_408():
    async def scenario():
        adm = Admission(1, queue_size=1, queue_timeout_s=0.2)
        await adm.acquire()
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0.01)
        assert adm.queued == 1
        with pytest.raises(Refused) as full:
            await adm.acquire()
        assert full.value.status == 429 and full.value.retry_after_s >= 1
        adm.release()  # the waiter inherits the slot
        await asyncio.wait_for(waiter, 1)
        assert adm.in_flight == 1 and adm.queued == 0
        with pytest.raises(Refused) as late:
            await adm.acquire()  # waits 0.2 s in the queue, then 408
        assert late.value.status == 408 and adm.queued == 0
        adm.release()
        assert adm.in_flight == 0
        await adm.acquire()
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0.01)
        waiter.cancel()  # a waiter that leaves gives up its place
        await asyncio.gather(waiter, return_exceptions=True)
        assert adm.queued == 0
        adm.release()
        assert adm.in_flight == 0
        adm.draining = True
        with pytest.raises(Refused) as drain:
            await adm.acquire()
        assert drain.value.status == 503
    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_saturation_refusal_retry_after_is_soonest_free_worker():
    import time
    exc = saturation_refusal([time.monotonic() + 5.2, time.monotonic() + 2.5], [])
    assert exc.status == 429 and exc.retry_after_s == 3


def test_guards_refuse_with_param_and_extract_prompt_text():
    cfg = RouterConfig(max_n=2, max_tokens_limit=100, max_prompt_tokens=10)
    req = route_request("chat", b'{"messages": [{"role": "system", "content": "S"}, '
                        b'{"role": "user", "content": [{"type": "text", "text": "U"}]}], '
                        b'"cache_salt": "t1"}', cfg)
    assert (req.text, req.cache_salt, req.prompt_tokens) == ("S\nU", "t1", 1)
    assert route_request("completions", b'{"prompt": ["ab", "c"]}', cfg).text == "ab"
    assert route_request("completions", b'{"prompt": [1, 2, 3]}', cfg).text == ""
    bad = [(b'{"prompt": "x", "n": 3}', "n"), (b'{"prompt": "x", "max_tokens": 101}',
                                                 "max_tokens"),
           (b'{"prompt": "x", "n": "2"}', "n"), (b'{"prompt": "' + b"x" * 80 + b'"}', "prompt"),
           (b'[1]', None), (b'{', None)]
    for raw, param in bad:
        with pytest.raises(Refused) as exc:
            route_request("completions", raw, cfg)
        assert exc.value.status == 400 and exc.value.param == param
    with pytest.raises(Refused):
        route_request("chat", b'{"messages": "hi"}', cfg)


def test_parse_metrics_reads_heron_gauges_and_counters():
    text = ("# HELP heron:num_requests_waiting x\nheron:num_requests_waiting 3.0\n"
            'heron:num_requests_running{model_name="m"} 2.0\n'
            "heron:prefix_cache_queries_total 100.0\nheron:prefix_cache_hits_total 40.0\n"
            "heron:prefix_cache_hits_created 1.7e9\nother 1\n")
    assert parse_metrics(text) == {"heron:num_requests_waiting": 3.0,
                                   "heron:num_requests_running": 2.0,
                                   "heron:prefix_cache_queries_total": 100.0,
                                   "heron:prefix_cache_hits_total": 40.0}


def test_registry_and_worker_file(tmp_path):
    assert normalize_url("127.0.0.1:8000/") == "http://127.0.0.1:8000"
    with pytest.raises(ValueError):
        normalize_url("ftp://x")
    path = tmp_path / "workers.txt"
    path.write_text("# workers\nhttp://a:1  b:2\n\nc:3 # last\n")
    assert read_worker_file(str(path)) == ["http://a:1", "http://b:2", "http://c:3"]
    reg = WorkerRegistry(RouterConfig())
    added, removed = [], []
    reg.added_listeners.append(lambda w: added.append(w.url))
    reg.removed_listeners.append(lambda w: removed.append(w.url))
    reg.add("http://z:9", "api")
    reg.sync_source("file", ["http://a:1", "http://b:2"])
    reg.sync_source("file", ["http://b:2", "http://c:3"])
    assert [w.url for w in reg.all()] == ["http://z:9", "http://b:2", "http://c:3"]
    assert added == ["http://z:9", "http://a:1", "http://b:2", "http://c:3"]
    assert removed == ["http://a:1"]
    w = reg.get("b:2")
    w.waiting_requests = 5
    assert not w.saturated(RouterConfig())
    assert w.saturated(RouterConfig(max_worker_waiting_requests=4))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError):
        RouterConfig(policy="nope")
    with pytest.raises(ValueError):
        RouterConfig(cb_failure_threshold=0)
    assert RouterConfig(retry_max_retries=2).max_attempts == 3
