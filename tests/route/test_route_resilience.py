"""The router under failure: a worker killed under load (requests not yet streaming complete on
the other worker, streams already started end with an error event, the breaker opens and then
closes once the worker is back), a hung worker (SIGSTOP) caught by timeouts and health checks,
every worker saturated (429 + Retry-After from the router, no 5xx, nothing admitted lost), and
a SIGTERM drain. Each test starts its own router; the two workers are shared."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

FAST = ["--cb-failure-threshold", "2", "--cb-success-threshold", "2",
        "--cb-timeout-duration-secs", "1", "--health-check-interval-secs", "0.3",
        "--health-check-timeout-secs", "0.5", "--health-failure-threshold", "2",
        "--health-success-threshold", "1", "--retry-initial-backoff-ms", "10",
        "--retry-max-backoff-ms", "100"]


def _complete(url: str, max_tokens: int = 8, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout,
                      json={"model": "tiny", "prompt": "Hello there", "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True})


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _worker(router, url: str) -> dict:
    return next(w for w in router.workers() if w["url"] == url)


class Stream(threading.Thread):
    """A long streamed completion read to the end in a thread; ``started`` is set once the
    first event arrived (the response is committed)."""

    def __init__(self, url: str, max_tokens: int = 600) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.started = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "Tell me a story", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body,
                              timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc
        self.started.set()

    @property
    def errored(self) -> bool:
        return any(e != "[DONE]" and "error" in json.loads(e) for e in self.events)


def test_killed_worker_retries_breaks_streams_loudly_and_breaker_recovers(
        workers, start_router, metric_value):
    # 3 failures open the breaker: the two broken streams and the first request refused (the
    # health checks, 1 s apart, leave time for that request to meet the dead worker first)
    router = start_router("--worker-urls", *workers.urls, *FAST, "--cb-failure-threshold", "3",
                          "--health-check-interval-secs", "1")
    victim = workers.urls[1]
    streams = [Stream(router.url) for _ in range(4)]  # round robin: two on each worker
    for s in streams:
        s.start()
        assert s.started.wait(30)
    workers.kill(1)  # SIGKILL: a crash, mid-stream
    with ThreadPoolExecutor(2) as pool:  # not yet streaming: must land on worker 0
        answers = list(pool.map(lambda _: _complete(router.url), range(6)))
    assert [a.status_code for a in answers] == [200] * 6
    for s in streams:
        s.join(60)
        assert not s.is_alive() and s.error is None, s.error
        assert s.events[-1] == "[DONE]"  # never silently
    assert sum(s.errored for s in streams) == 2  # the two on the killed worker
    _wait(lambda: not _worker(router, victim)["healthy"], 10, "the health check")
    text = router.metrics()
    assert metric_value(text, "heron_router:breaker_transitions_total", worker=victim,
                        from_state="closed", to_state="open") == 1, text
    assert metric_value(text, "heron_router:retries_total") >= 1, text
    workers.restart(1, startup_timeout_s=120)
    _wait(lambda: _worker(router, victim)["healthy"], 10, "the worker's return")
    deadline = time.monotonic() + 30
    while _worker(router, victim)["breaker"] != "closed" and time.monotonic() < deadline:
        assert _complete(router.url).status_code == 200  # half-open probes go through
    assert _worker(router, victim)["breaker"] == "closed"
    assert metric_value(router.metrics(), "heron_router:breaker_transitions_total",
                        worker=victim, from_state="half_open", to_state="closed") == 1


def test_hung_worker_is_caught_by_the_request_timeout(workers, start_router):
    # health checks 10 s apart: here the 2 s request timeout is what notices
    router = start_router("--worker-urls", *workers.urls, *FAST,
                          "--health-check-interval-secs", "10", "--request-timeout-secs", "2")
    workers.kill(1, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:  # round robin: one goes to the hung worker
            t0 = time.monotonic()
            answers = list(pool.map(lambda _: _complete(router.url), range(2)))
        assert [a.status_code for a in answers] == [200, 200], router.log_tail()
        assert time.monotonic() - t0 < 15
    finally:
        workers.kill(1, signal.SIGCONT)


def test_hung_worker_is_caught_by_health_checks_which_abort_its_requests(
        workers, start_router, metric_value):
    router = start_router("--worker-urls", *workers.urls, *FAST)
    hung = workers.urls[1]
    streams = [Stream(router.url) for _ in range(2)]  # one on each worker
    for s in streams:
        s.start()
        assert s.started.wait(30)
    workers.kill(1, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:  # one waits on the hung worker until it is caught
            answers = list(pool.map(lambda _: _complete(router.url), range(2)))
        assert [a.status_code for a in answers] == [200, 200]
        assert not _worker(router, hung)["healthy"]
        assert httpx.get(f"{router.url}/ready", timeout=5).status_code == 200
        for s in streams:
            s.join(60)
            assert s.error is None and s.events[-1] == "[DONE]"
        assert [s.errored for s in streams] == [False, True]  # the hung one ends loudly
        assert metric_value(router.metrics(), "heron_router:retries_total",
                            reason="unhealthy") >= 1
    finally:
        workers.kill(1, signal.SIGCONT)
    _wait(lambda: _worker(router, hung)["healthy"], 15, "the worker's recovery")


def test_saturated_workers_get_429_with_retry_after_and_no_5xx(workers, start_router,
                                                                metric_value):
    router = start_router("--worker-urls", *workers.urls, *FAST)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: _complete(router.url, max_tokens=400), range(16)))
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 2, codes
    for a in answers:
        if a.status_code == 429:
            assert int(a.headers["retry-after"]) >= 1
            assert a.json()["error"]["type"] == "rate_limit_exceeded"
        else:  # admitted: complete, nothing lost
            assert a.json()["usage"]["completion_tokens"] == 400
    assert metric_value(router.metrics(), "heron_router:rejected_total",
                        reason="saturated") >= 1


def test_sigterm_drains_in_flight_streams(workers, start_router):
    router = start_router("--worker-urls", *workers.urls)
    stream = Stream(router.url, max_tokens=300)
    stream.start()
    assert stream.started.wait(30)
    router.proc.send_signal(signal.SIGTERM)
    stream.join(60)
    assert stream.error is None and stream.events[-1] == "[DONE]" and not stream.errored
    assert router.proc.wait(30) == 0
