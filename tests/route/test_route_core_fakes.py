"""The router app in-process (uvicorn in a thread) in front of fake OpenAI workers whose every
answer the test chooses: retries on 5xx, 429 backpressure, a stream that breaks after its
first byte, a client that leaves, the router's own queue, the worker file, usage metrics and
the /metrics scrape of the workers."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from heron.route.app import build_app
from heron.route.config import RouterConfig
from server_fixture import free_port

METRICS = ("heron:num_requests_waiting 3.0\nheron:prefix_cache_queries_total 10.0\n"
           "heron:prefix_cache_hits_total 4.0\n")
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


class Served:
    """An ASGI app under uvicorn in a daemon thread on 127.0.0.1 (bounded start and stop)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class FakeWorker(Served):
    """Answers completions as told: ``modes`` (consumed one per request), then ``default``:
    ok, 500, 429, break (one chunk, then the connection drops), hold (one chunk, then
    nothing until the client leaves), slow (a 0.5 s non-streamed answer)."""

    def __init__(self, default: str = "ok") -> None:
        self.default, self.modes, self.calls = default, [], 0
        self.auth: list[str | None] = []  # the Authorization header of each completion
        self.left = threading.Event()  # a held stream saw its client leave
        super().__init__(Starlette(routes=[
            Route("/health", lambda r: JSONResponse({})),
            Route("/metrics", lambda r: PlainTextResponse(METRICS)),
            Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "fake"}]})),
            Route("/v1/completions", self.completions, methods=["POST"])]))

    async def completions(self, request: Request):
        self.calls += 1
        self.auth.append(request.headers.get("authorization"))
        mode = self.modes.pop(0) if self.modes else self.default
        body = await request.json()
        if mode in ("500", "429"):
            return JSONResponse({"error": {"message": mode}}, int(mode),
                                headers={"Retry-After": "2"})
        if mode == "slow":
            await asyncio.sleep(0.5)
        if not body.get("stream"):
            return JSONResponse({"id": "x", "choices": [{"text": "hi"}], "usage": USAGE})
        return StreamingResponse(self.events(mode), media_type="text/event-stream")

    async def events(self, mode: str):
        yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        if mode == "break":
            raise RuntimeError("the worker died mid-stream")
        if mode == "hold":
            try:
                for _ in range(200):
                    await asyncio.sleep(0.05)
                    yield b": keep-alive\n\n"
            finally:
                self.left.set()
        yield f'data: {json.dumps({"choices": [], "usage": USAGE})}\n\n'.encode()
        yield b"data: [DONE]\n\n"


@pytest.fixture
def fakes():
    made: list[Served] = []

    def make(cls, *args):
        made.append(cls(*args))
        return made[-1]
    yield make
    for served in reversed(made):
        served.stop()


def _router(fakes, *workers: FakeWorker, **overrides) -> Served:
    cfg = dict(worker_urls=tuple(w.url for w in workers), health_check_interval_secs=0.2,
               retry_initial_backoff_ms=1, retry_max_backoff_ms=5, request_timeout_secs=10)
    return fakes(Served, build_app(RouterConfig(**{**cfg, **overrides})))


def _post(router: Served, **body) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", json={"model": "fake", "prompt": "p",
                                                            **body}, timeout=10)


def _metric(router: Served, line_start: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=5).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(line_start))


def test_5xx_is_retried_on_another_worker(fakes):
    a, b = fakes(FakeWorker), fakes(FakeWorker)
    a.modes.append("500")  # its first answer only
    router = _router(fakes, a, b)
    answers = [_post(router) for _ in range(2)]
    assert [r.status_code for r in answers] == [200, 200]
    assert a.calls == 2 and b.calls == 1
    assert _metric(router, 'heron_router:retries_total{reason="status_500"') == 1
    assert _metric(router, 'heron_router:prompt_tokens_total{model="fake"}') == 6
    everywhere = fakes(FakeWorker, "500")
    alone = _router(fakes, everywhere, retry_max_retries=1)
    assert _post(alone).status_code == 500  # the worker's own answer, after the retries
    assert everywhere.calls == 2


def test_workers_429_become_the_routers_429(fakes):
    a, b = fakes(FakeWorker, "429"), fakes(FakeWorker, "429")
    router = _router(fakes, a, b)
    first = _post(router)
    assert first.status_code == 429 and int(first.headers["retry-after"]) >= 1
    assert first.json()["error"]["type"] == "rate_limit_exceeded"
    calls = a.calls + b.calls
    assert _post(router).status_code == 429  # both resting: refused without asking them
    assert a.calls + b.calls == calls == 2
    workers = httpx.get(f"{router.url}/workers", timeout=5).json()["workers"]
    assert all(w["breaker"] == "closed" for w in workers)  # backpressure is no failure


def test_stream_broken_after_first_byte_ends_with_error_event(fakes):
    a, b = fakes(FakeWorker, "break"), fakes(FakeWorker)
    router = _router(fakes, a, b)
    with httpx.stream("POST", f"{router.url}/v1/completions", timeout=10,
                      json={"prompt": "p", "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "a"
    assert json.loads(lines[1][6:])["error"]["type"] == "upstream_error"
    assert lines[-1] == "data: [DONE]" and b.calls == 0  # committed: never retried


def test_client_leaving_cancels_the_upstream_request(fakes):
    a = fakes(FakeWorker, "hold")
    router = _router(fakes, a)
    with httpx.stream("POST", f"{router.url}/v1/completions", timeout=10,
                      json={"prompt": "p", "stream": True}) as resp:
        next(resp.iter_lines())
    assert a.left.wait(5)
    deadline = time.monotonic() + 5
    while httpx.get(f"{router.url}/workers", timeout=5).json()["workers"][0][
            "outstanding_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{router.url}/workers", timeout=5).json()["workers"][0][
        "outstanding_requests"] == 0


def test_router_queue_full_answers_429(fakes):
    a = fakes(FakeWorker, "slow")
    router = _router(fakes, a, max_concurrent_requests=1, queue_size=0)
    results = []
    threads = [threading.Thread(target=lambda: results.append(_post(router).status_code))
               for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(10)
    assert sorted(results) == [200, 429]
    assert _metric(router, 'heron_router:rejected_total{reason="queue_full"}') == 1


def test_worker_file_is_reread_and_ready_follows_it(fakes, tmp_path):
    a, b = fakes(FakeWorker), fakes(FakeWorker)
    path = tmp_path / "workers.txt"
    path.write_text("")
    router = _router(fakes, worker_file=str(path))
    assert httpx.get(f"{router.url}/ready", timeout=5).status_code == 503
    assert _post(router).status_code == 503
    path.write_text(f"{a.url}\n")
    deadline = time.monotonic() + 5
    while httpx.get(f"{router.url}/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.05)
    path.write_text(f"# swapped\n{b.url}\n")
    while [w["url"] for w in httpx.get(f"{router.url}/workers", timeout=5).json()[
            "workers"]] != [b.url]:
        assert time.monotonic() < deadline + 5
        time.sleep(0.05)
    worker = httpx.get(f"{router.url}/workers", timeout=5).json()["workers"][0]
    assert worker["waiting_requests"] == 3 and worker["prefix_cache_hit_rate"] == 0.4
    assert httpx.get(f"{router.url}/v1/models", timeout=5).json()["data"] == [{"id": "fake"}]
    assert _metric(router, "heron_router:reported_prefix_hit_rate") == 0.4


def test_worker_key_goes_upstream_and_long_worker_queues_saturate(fakes):
    a = fakes(FakeWorker)
    router = _router(fakes, a, api_key="router-key", worker_api_key="worker-key")
    headers = {"Authorization": "Bearer router-key"}
    resp = httpx.post(f"{router.url}/v1/completions", json={"prompt": "p"}, headers=headers,
                      timeout=10)
    assert resp.status_code == 200 and a.auth == ["Bearer worker-key"]
    busy = _router(fakes, a, max_worker_waiting_requests=2)  # the fake reports 3 waiting
    resp = _post(busy)
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
    assert a.calls == 1
