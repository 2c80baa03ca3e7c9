"""How `heron serve` stops (issue 22, items 11, 13, 14): nothing in flight ends silently, the
port answers 503 while draining, and every request is counted however it ends.

Most tests run the real HTTP server and stop sequence in front of a fake engine that never
finishes a request on its own (``slow_engine_server.py``: no model, starts in a second), so
"generations longer than the grace" hold by construction, not by timing. The tiny random
Llama checks the same against the real engine. Servers bind 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_core import offline_client, sent
from heron.sampling_params import SamplingParams
from heron.server.failures import classify
from heron.transport import messages as m
from heron.transport.async_client import RequestAbortedError
from server_fixture import HeronServer, free_port, wait_until_answering

SLOW_SERVER = Path(__file__).resolve().parents[1] / "helpers" / "slow_engine_server.py"
STREAM = {"prompt": [1, 2, 3], "max_tokens": 1000, "stream": True}
PLAIN = {"prompt": [1, 2, 3], "max_tokens": 1000}


class SlowServer:
    """``slow_engine_server.py`` as a subprocess, its log in a file."""

    def __init__(self, tmp_path: Path, shutdown_timeout: float, hold: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.record_path = tmp_path / "record.json"
        self.log_path = tmp_path / "server.log"
        self.release_path = tmp_path / "release"  # with hold: the engine stops once it exists
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(SLOW_SERVER), str(self.port), str(shutdown_timeout),
                 str(self.record_path), *([str(self.release_path)] if hold else [])],
                stdout=log, stderr=subprocess.STDOUT)
        if wait_until_answering(f"{self.url}/ready", self.proc, 60, 0.1):
            return
        self.kill()
        raise RuntimeError(f"slow server did not start: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def record(self) -> dict:
        return json.loads(self.record_path.read_text())

    def running(self) -> int:
        return httpx.get(f"{self.url}/stats", timeout=5).json()["num_running"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture()
def slow_server(request, tmp_path):
    servers = []

    def start(shutdown_timeout: float, hold: bool = False) -> SlowServer:
        servers.append(SlowServer(tmp_path, shutdown_timeout, hold))
        return servers[-1]

    yield start
    for srv in servers:
        srv.kill()


class Stream:
    """One SSE request read on a thread: its data payloads (dicts, or "[DONE]")."""

    def __init__(self, url: str, body: dict) -> None:
        self.events: list = []
        self.first = threading.Event()
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except Exception as exc:  # noqa: BLE001 - the test asserts there is none
            self.error = exc
        finally:
            self.first.set()


class Plain:
    """One non-streaming request on a thread: its response (or the exception)."""

    def __init__(self, url: str, body: dict) -> None:
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._send, args=(url, body), daemon=True)
        self.thread.start()

    def _send(self, url: str, body: dict) -> None:
        try:
            self.response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        except Exception as exc:  # noqa: BLE001 - the test asserts there is none
            self.error = exc


def _wait(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def _assert_503(r: httpx.Response, retry_after: bool) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == 503 and error["type"] == "service_unavailable" and error["message"]
    if retry_after:
        assert int(r.headers["retry-after"]) >= 1


# ---- 11. the grace runs out: every client hears it ------------------------------------------
def test_abort_all_ends_open_requests_and_refuses_new_ones():
    """The client side of the cut: open generations raise RequestAbortedError (a 503), the
    core gets one Abort naming them all, and later requests are refused the same way."""
    params = SamplingParams(max_tokens=5)

    async def scenario():
        client = offline_client()
        pending = asyncio.ensure_future(anext(client.generate("r", [1, 2], params)))
        await asyncio.sleep(0)  # the AddRequest is sent, the generator waits for output
        assert client.abort_all("shutting down") == 1
        with pytest.raises(RequestAbortedError, match="shutting down"):
            await pending
        with pytest.raises(RequestAbortedError):
            await anext(client.generate("s", [1], params))
        return sent(client)

    messages = asyncio.run(scenario())
    assert [x.request_id for x in messages if isinstance(x, m.AddRequest)] == ["r"]
    assert ["r"] in [x.request_ids for x in messages if isinstance(x, m.Abort)]
    assert classify(RequestAbortedError("x"))[:2] == (503, "x")


def test_requests_longer_than_the_grace_end_with_an_error_event_or_a_json_503(slow_server):
    srv = slow_server(shutdown_timeout=1)
    streams = [Stream(srv.url, STREAM) for _ in range(3)]
    plains = [Plain(srv.url, PLAIN) for _ in range(3)]
    assert all(s.first.wait(30) for s in streams)
    assert _wait(lambda: srv.running() == 6)  # all six are in the engine
    srv.proc.send_signal(signal.SIGTERM)
    for client in streams + plains:
        client.thread.join(60)
        assert not client.thread.is_alive() and client.error is None
    for s in streams:
        assert len(s.events) > 1 and "[DONE]" not in s.events
        error = s.events[-1]["error"]
        assert error["code"] == 503 and "grace period" in error["message"]
    for p in plains:
        _assert_503(p.response, retry_after=False)
        assert "grace period" in p.response.json()["error"]["message"]
    assert srv.proc.wait(60) == 0
    record = srv.record()
    assert len(record["added"]) == 6 and set(record["aborted"]) == set(record["added"])
    assert record["shut_down"]
    log = srv.log()
    assert "CancelledError" not in log and "Traceback" not in log
    assert log.count("finish=abort") == 6  # every cut request has its log line


def test_requests_that_finish_within_the_grace_are_not_cut(slow_server):
    srv = slow_server(shutdown_timeout=60)
    stream = Stream(srv.url, {**STREAM, "max_tokens": 40})  # ~2 s at 50 ms a token
    assert stream.first.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    stream.thread.join(60)
    assert stream.events[-1] == "[DONE]"
    assert stream.events[-2]["choices"][0]["finish_reason"] == "length"
    assert srv.proc.wait(60) == 0
    assert srv.record()["aborted"] == []


# ---- 13. draining answers 503, the port stays open ------------------------------------------
def test_draining_answers_503_with_retry_after_and_ready_fails(slow_server):
    srv = slow_server(shutdown_timeout=60)
    assert httpx.get(f"{srv.url}/ready").status_code == 200
    assert httpx.get(f"{srv.url}/health").status_code == 200
    stream = Stream(srv.url, STREAM)  # keeps the server draining until the test lets go
    assert stream.first.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    assert _wait(lambda: httpx.get(f"{srv.url}/ready").status_code == 503)
    _assert_503(httpx.get(f"{srv.url}/ready"), retry_after=True)
    _assert_503(httpx.get(f"{srv.url}/health"), retry_after=True)
    _assert_503(httpx.post(f"{srv.url}/v1/completions", json=PLAIN), retry_after=True)
    _assert_503(httpx.post(f"{srv.url}/v1/completions", json=STREAM), retry_after=True)
    assert httpx.get(f"{srv.url}/metrics").status_code == 200  # scrapers still see it
    before = len(stream.events)
    assert _wait(lambda: len(stream.events) > before + 2)  # the open stream goes on
    assert srv.proc.poll() is None
    srv.proc.send_signal(signal.SIGINT)  # a second signal: stop waiting, cut now
    stream.thread.join(60)
    assert stream.events[-1]["error"]["code"] == 503 and "[DONE]" not in stream.events
    assert srv.proc.wait(60) == 0


def test_after_an_engine_failure_the_port_answers_503_until_the_engine_has_stopped(
        slow_server):
    """The (fake) core dies and the test holds its stop: all the while /health and /ready
    answer 503 (the listener is still open); once it has stopped the server exits 1."""
    srv = slow_server(shutdown_timeout=30, hold=True)
    stream = Stream(srv.url, STREAM)
    assert stream.first.wait(30)
    r = httpx.post(f"{srv.url}/v1/completions", json={**PLAIN, "prompt": [999]}, timeout=30)
    assert r.status_code == 503  # the request that killed the fake core
    stream.thread.join(30)
    assert stream.events[-1]["error"]["code"] == 503 and "[DONE]" not in stream.events
    for _ in range(5):  # the engine is stopping (held): the port still answers
        _assert_503(httpx.get(f"{srv.url}/health", timeout=5), retry_after=True)
        _assert_503(httpx.get(f"{srv.url}/ready", timeout=5), retry_after=True)
    assert srv.proc.poll() is None
    srv.release_path.touch()
    assert srv.proc.wait(30) == 1


# ---- 14. aborted requests are counted -------------------------------------------------------
def _samples(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if "le" not in s.labels}


def test_streams_left_early_are_counted_in_metrics_and_logged(served_model):
    srv = HeronServer(served_model)
    try:
        abort = ("heron:request_success_total", (("finished_reason", "abort"),))
        e2e = ("heron:e2e_request_latency_seconds_count", ())
        before = _samples(srv.url)
        body = {"prompt": "x", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        for _ in range(5):  # three events each, then the client leaves
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
                data = (line for line in r.iter_lines() if line.startswith("data: "))
                assert [next(data) for _ in range(3)]
        assert _wait(lambda: _samples(srv.url).get(abort, 0) - before.get(abort, 0) >= 5)
        stats = srv.wait_for(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0)
        after = _samples(srv.url)
        assert after[abort] - before.get(abort, 0) == 5
        assert after[e2e] - before.get(e2e, 0) == 5
        # every token the engine generated is counted, those of left streams too
        assert after[("heron:generation_tokens_total", ())] == \
            stats["num_generation_tokens_total"]
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert srv.log_tail(100_000).count("finish=abort") == 5
    finally:
        assert srv.stop() == 0


def _cut_by_the_grace(error: dict) -> bool:
    assert error["code"] == 503 and error["type"] == "service_unavailable"
    return "grace period" in error["message"]  # otherwise refused: it came after SIGTERM


def test_sigterm_with_no_grace_cuts_the_real_engine_loudly(served_model):
    """One sequence at a time, four requests of 1000 tokens: when the first stream's first
    event arrives, SIGTERM with --shutdown-timeout 0 cuts at least that one. Each client ends
    with a whole answer or an error event / JSON 503, never silently."""
    srv = HeronServer(served_model, "--shutdown-timeout", "0", "--max-num-seqs", "1")
    try:
        body = {"prompt": "x", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        first = Stream(srv.url, {**body, "stream": True})
        assert first.first.wait(60)
        others = [Stream(srv.url, {**body, "stream": True}), Plain(srv.url, body),
                  Plain(srv.url, body)]
        srv.wait_for(lambda s: s["num_unfinished_requests"] == 4, timeout=10)
        os.kill(srv.proc.pid, signal.SIGTERM)
        cut = 0
        for client in [first] + others:
            client.thread.join(60)
            assert not client.thread.is_alive() and client.error is None
            if isinstance(client, Stream) and client.events[-1] == "[DONE]":
                assert client.events[-2]["choices"][0]["finish_reason"] == "length"
            elif isinstance(client, Stream):
                assert "[DONE]" not in client.events
                cut += _cut_by_the_grace(client.events[-1]["error"])
            elif client.response.status_code == 200:
                assert client.response.json()["choices"][0]["finish_reason"] == "length"
            else:
                _assert_503(client.response, retry_after=False)
                cut += _cut_by_the_grace(client.response.json()["error"])
        assert first.events[-1] != "[DONE]" and cut >= 1
        assert srv.proc.wait(60) == 0
        assert srv.log_tail(100_000).count("finish=abort") == cut
    finally:
        srv.stop()
