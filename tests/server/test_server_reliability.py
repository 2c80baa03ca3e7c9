"""Reliability of `heron serve`: one regression test per finding of the attack on 2026-12-01.

No request can take the engine down, a stream never ends silently, every failure is a clear
status in OpenAI's shape. A tiny random Llama with SmolLM2's tokenizer keeps each request in
the milliseconds; servers bind 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_fixture import HeronServer

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAULT_TOKEN = 4321  # HERON_FAULT_INJECTION_TOKEN: requests holding it fail inside the engine


@pytest.fixture(scope="module")
def server_args(served_model):
    return (served_model, "--api-key", KEY, "--max-queued-sequences", "64",
            "--max-sequences-per-request", "32")


@pytest.fixture(scope="module")
def server_env():
    return {"HERON_FAULT_INJECTION_TOKEN": str(FAULT_TOKEN)}


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def _completion(**kw):
    return {"prompt": "Tell me about the sea.", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **kw}


def _assert_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    if param is not None:
        assert error["param"] == param
    return error


def _assert_serving(server) -> None:
    """The engine is alive and answers; nothing is left running, every block is free."""
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json=_completion(max_tokens=2), headers=AUTH,
                   timeout=60)
    assert r.status_code == 200, r.text
    stats = server.wait_for(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0
                            and s["num_free_blocks"] == s["num_blocks"], timeout=30)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def _sse(lines) -> list:
    """The data payloads of an SSE stream: dicts, and the string "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- 1. one request killed the engine -------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_vocab_stop_token_with_min_tokens_is_400_and_engine_lives(server, client, path):
    body = {"max_tokens": 4, "min_tokens": 2, "stop_token_ids": [1_000_000_000]}
    body |= ({"prompt": "Hi"} if "chat" not in path else
             {"messages": [{"role": "user", "content": "Hi"}]})
    _assert_error(client.post(path, json=body), 400, "stop_token_ids")
    _assert_error(client.post(path, json={**body, "stop_token_ids": [-1]}), 400,
                  "stop_token_ids")
    _assert_serving(server)


def test_a_request_failing_inside_the_engine_costs_only_itself(server, client):
    """A fault while the engine processes one request: that request gets 500 (streaming: an
    error event and no [DONE]); the requests next to it finish normally."""

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as ac:
            healthy = [ac.post("/v1/completions", json=_completion(max_tokens=24))
                       for _ in range(4)]
            poisoned = ac.post("/v1/completions", json=_completion(prompt=[5, FAULT_TOKEN, 9]))
            return await asyncio.gather(poisoned, *healthy)

    poisoned, *healthy = asyncio.run(main())
    error = _assert_error(poisoned, 500)
    assert "injected fault" in error["message"]
    assert all(r.status_code == 200 for r in healthy)
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in healthy)
    with client.stream("POST", "/v1/completions",
                       json=_completion(prompt=[FAULT_TOKEN], stream=True)) as r:
        assert r.status_code == 200
        events = _sse(r.iter_lines())
    assert "[DONE]" not in events and events[-1]["error"]["code"] == 500
    _assert_serving(server)


# ---- 2. a disconnected non-streaming request ran to the end ---------------------------------
def _abort_count(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    line = [l for l in text.splitlines()
            if l.startswith('heron:request_success_total{finished_reason="abort"}')]
    return float(line[0].split()[-1]) if line else 0.0


def test_non_streaming_request_is_aborted_when_its_client_leaves(server):
    """The client leaves while its request runs (seen running in /stats, so no race with a fast
    model finishing first): the engine aborts it, frees every block, and counts it "abort"."""
    server.wait_for(lambda s: s["num_running"] == 0)
    aborted_before = _abort_count(server)
    body = json.dumps(_completion(max_tokens=900, prompt="x", n=32))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body, {**AUTH, "content-type": "application/json"})
        running = server.wait_for(lambda s: s["num_running"] > 0, 30)
        assert running["num_running"] > 0, "the request never ran"
    finally:
        conn.close()  # leave without reading the response
    stats = server.wait_for(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0, 30)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert _abort_count(server) == aborted_before + 1
    _assert_serving(server)


# ---- 3. 500s for huge integers and surrogates ------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("top_k", 2**64), ("min_tokens", 2**70), ("stop_token_ids", [2**70]), ("prompt", [2**70]),
    ("seed", 2**64), ("n", 2**64), ("max_tokens", -2**70), ("logprobs", 2**100),
])
def test_integers_beyond_64_bits_are_400_and_keep_alive_survives(server, field, value):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {**AUTH, "content-type": "application/json"}
    try:
        conn.request("POST", "/v1/completions", json.dumps(_completion(**{field: value})),
                     headers)
        bad = conn.getresponse()
        error = json.loads(bad.read())["error"]
        assert bad.status == 400 and error["param"] == field and error["code"] == 400
        sock = conn.sock  # the same connection must serve the next request
        conn.request("POST", "/v1/completions", json.dumps(_completion(max_tokens=1)), headers)
        good = conn.getresponse()
        good.read()
        assert good.status == 200 and conn.sock is sock
    finally:
        conn.close()


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", '{"prompt": "Hi \\ud800", "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    ("/tokenize", '{"prompt": "Hi \\ud800"}'),
])
def test_lone_surrogates_are_400(client, path, raw):
    r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    _assert_error(r, 400)
    assert client.post("/tokenize", json={"prompt": "Hi \U0001F600"}).status_code == 200


# ---- 4. streams that ended as if nothing happened --------------------------------------------
def test_streams_refused_by_the_engine_say_so(client):
    """Requests the engine would refuse are refused before the stream starts (400); an n = 2
    request with the largest seed (child seed wraps around 64 bits) streams to [DONE]."""
    r = client.post("/v1/completions", json=_completion(prompt=[1_000_000_000], stream=True))
    _assert_error(r, 400, "prompt")
    body = _completion(seed=2**64 - 1, n=2, temperature=1.0, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert sorted(e["choices"][0]["index"] for e in events[:-1]
                  if e["choices"][0]["finish_reason"]) == [0, 1]


def _start_stream(url: str, body: dict, headers=None):
    """Open a stream in a thread; returns (thread, collected lines, first-chunk event)."""
    lines: list[str] = []
    first = threading.Event()

    def read():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                              timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()
        except httpx.HTTPError as exc:
            lines.append(f"transport error: {exc!r}")
        first.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, lines, first


def test_engine_death_mid_stream_ends_streams_with_an_error_and_the_server_exits_1(served_model):
    srv = HeronServer(served_model)
    try:
        body = _completion(max_tokens=1000, prompt="x", stream=True)
        thread, lines, first = _start_stream(srv.url, body)
        assert first.wait(30)
        os.kill(srv.stats()["engine_pid"], signal.SIGKILL)
        thread.join(30)
        events = _sse(lines)
        assert "[DONE]" not in events and events[-1]["error"]["code"] == 503
        assert srv.proc.wait(40) == 1  # a supervisor restarts it
    finally:
        srv.stop()


def _health(url: str) -> int | None:
    """/health's status, or None once the server is closing its sockets or has exited."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:  # refused, or reset on the way out
        return None


def test_frozen_engine_fails_health_within_seconds_and_the_server_exits_1(served_model):
    srv = HeronServer(served_model)
    pid = srv.stats()["engine_pid"]
    try:
        thread, lines, first = _start_stream(srv.url, _completion(max_tokens=1000, prompt="x",
                                                                  stream=True))
        assert first.wait(30)
        os.kill(pid, signal.SIGSTOP)
        frozen_at, statuses = time.monotonic(), []
        while time.monotonic() - frozen_at < 20 and statuses[-1:] in ([], [200]):
            statuses.append(_health(srv.url))
            time.sleep(0.2)
        assert statuses[-1] in (503, None)  # unhealthy (or already exited) within seconds
        thread.join(30)
        assert _sse(lines)[-1]["error"]["code"] == 503
        assert srv.proc.wait(40) == 1
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        srv.stop()


# ---- 5. body limit bypass and a blocked event loop -------------------------------------------
def test_chunked_body_over_the_limit_is_413(client):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 100_000
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(),
                    headers={"content-type": "application/json"})
    _assert_error(r, 413)


def test_tokenizing_a_large_body_does_not_block_the_event_loop(server):
    body = {"prompt": "hello world " * 300_000, "max_tokens": 1}  # ~3.6 MB, 600k tokens
    result = {}

    def big():
        result["r"] = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH,
                                 timeout=120)

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)  # the big body is being read and tokenized
    answered_while_busy = 0
    while thread.is_alive() and answered_while_busy < 3:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        answered_while_busy += thread.is_alive()
    thread.join(120)
    _assert_error(result["r"], 400, "prompt")  # far beyond the context
    assert answered_while_busy >= 1


# ---- 6. silently ignored parameters, NaN sampling, unbounded fan-out ------------------------
@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_object"}), ("best_of", 4), ("logit_bias", {"1": 2}),
    ("guided_json", {"type": "object"}), ("temperature", float("inf")), ("top_p", float("nan")),
])
def test_unimplemented_or_non_finite_parameters_are_400(client, field, value):
    raw = json.dumps(_completion(**{field: value}))  # json writes Infinity / NaN literals
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    _assert_error(r, 400, field)


def test_tiny_temperature_is_greedy_and_tiny_repetition_penalty_is_finite(client):
    def tokens(**kw):
        r = client.post("/v1/completions", json=_completion(max_tokens=12, logprobs=0, **kw))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    assert tokens(temperature=1e-45) == tokens(temperature=0)
    penalized = tokens(temperature=1.0, repetition_penalty=1e-300, seed=3)
    assert len(set(penalized)) > 1  # not NaN-sampled token 0 over and over


def test_fan_out_per_request_and_in_flight_is_bounded(server, client):
    r = client.post("/v1/completions", json=_completion(prompt=["a"] * 8, n=8))
    _assert_error(r, 400, "prompt")  # 64 sequences > 32 per request

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as ac:
            body = _completion(max_tokens=64, n=32)
            return await asyncio.gather(*(ac.post("/v1/completions", json=body)
                                          for _ in range(6)))

    codes = [r.status_code for r in asyncio.run(main())]
    assert set(codes) <= {200, 429} and 429 in codes  # 64 queued sequences at most
    _assert_serving(server)


# ---- 7. error shapes, OpenAPI, auth ----------------------------------------------------------
@pytest.mark.parametrize("content,headers,status", [
    (gzip.compress(b'{"prompt": "hi"}'), {"content-encoding": "gzip"}, 415),
    (b'{"prompt": "\xff\xfe"}', {}, 400),
    (b"[" * 10_000 + b"]" * 10_000, {}, 400),
    (b'{"prompt": "hi", "max_tokens": 2', {}, 400),
])
def test_parse_errors_answer_in_openai_shape(client, content, headers, status):
    r = client.post("/v1/completions", content=content,
                    headers={"content-type": "application/json", **headers})
    error = _assert_error(r, status)
    assert error["param"] is None  # not a character offset


def test_404_405_and_head_health(server, client):
    _assert_error(client.get("/v1/no-such-route"), 404)
    _assert_error(client.get("/v1/completions"), 405)
    assert httpx.head(f"{server.url}/health").status_code == 200


def test_openapi_documents_what_the_server_answers(client):
    doc = client.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        assert set(op["responses"]) == {"200", "400", "401", "404", "408", "413", "415", "429",
                                     "500", "503"}
        assert "text/event-stream" in op["responses"]["200"]["content"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert "422" not in json.dumps(doc["paths"])


def test_auth_covers_stats_and_docs_and_accepts_any_scheme_case(server):
    for path in ("/stats", "/docs", "/openapi.json", "/v1/models"):
        _assert_error(httpx.get(f"{server.url}{path}"), 401)
        _assert_error(httpx.get(f"{server.url}{path}", headers={
            "Authorization": f"Bearer {KEY}x"}), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200


@pytest.mark.parametrize("field,value", [("n", "2"), ("n", True), ("max_tokens", 1.0),
                                         ("stream", 1), ("echo", "true"), ("stop", 5)])
def test_no_silent_coercion(client, field, value):
    _assert_error(client.post("/v1/completions", json=_completion(**{field: value})), 400, field)


def _worker_ranks(engine_pid: int) -> list[int]:
    """Pids of the engine core's worker-rank processes."""
    ranks = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == engine_pid and b"heron.executor.worker_process" in cmdline:
            ranks.append(int(entry))
    return ranks


def test_a_killed_worker_rank_ends_streams_with_503_and_the_server_exits_1(served_model):
    srv = HeronServer(served_model, "--tensor-parallel-size", "2")
    try:
        thread, lines, first = _start_stream(srv.url, _completion(max_tokens=1000, prompt="x",
                                                                  stream=True))
        assert first.wait(60)
        ranks = _worker_ranks(srv.stats()["engine_pid"])
        assert len(ranks) == 2
        os.kill(ranks[-1], signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive()  # the stream ended: the rank's exit was noticed
        assert _sse(lines)[-1]["error"]["code"] == 503
        assert srv.proc.wait(40) == 1
    finally:
        srv.stop()
