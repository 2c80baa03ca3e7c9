"""The prefix cache through `heron serve`: cached tokens in usage, metrics, cache salts, KV
events on a ZMQ PUB socket, and the reset admin call. Server on 127.0.0.1, bounded waits."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq

from heron.engine.kv_events import decode_batch
from heron.engine.prefix_cache import block_hashes
from server_fixture import free_port

BLOCK = 16
PROMPT = list(range(1000, 1000 + 5 * BLOCK + 3))  # 5 full blocks and a partial one


@pytest.fixture(scope="module")
def events_endpoint():
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def server_args(events_endpoint):
    return ("--kv-events-endpoint", events_endpoint, "--block-size", str(BLOCK))


@pytest.fixture(scope="module")
def subscriber(server, events_endpoint):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(events_endpoint)
    time.sleep(0.5)  # PUB/SUB: let the subscription reach the publisher
    yield sock
    sock.close(linger=0)
    ctx.term()


def _events(sock, want, timeout: float = 20.0) -> list[dict]:
    """Receive events until ``want(events)`` holds or the timeout passes."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    while not want(events) and time.monotonic() < deadline:
        if sock.poll(200):
            topic, seq, payload = sock.recv_multipart()
            assert int.from_bytes(seq, "big") >= 1
            events += decode_batch(payload)[1]
    return events


def _complete(server, prompt, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **kw}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stored(events) -> list[int]:
    return [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]


def test_repeat_prompt_hits_and_events_name_its_blocks(server, subscriber):
    first = _complete(server, PROMPT)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    expected = block_hashes(PROMPT, BLOCK)
    events = _events(subscriber, lambda ev: set(expected) <= set(_stored(ev)))
    assert set(expected) <= set(_stored(events))
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert all(len(e["token_ids"]) == BLOCK * len(e["block_hashes"]) for e in stored)

    second = _complete(server, PROMPT)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK
    assert second["choices"][0]["text"] == first["choices"][0]["text"]

    text = httpx.get(f"{server.url}/metrics").text
    hits = [line for line in text.splitlines() if line.startswith("heron:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 5 * BLOCK
    assert "heron:prefix_cache_hit_rate" in text


def test_cache_salt_isolates_and_streams_report_cached_tokens(server):
    salted = _complete(server, PROMPT, cache_salt="tenant-a")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True,
            "cache_salt": "tenant-a", "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=lines[-1][6:]).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_reset_frees_unused_cached_blocks(server, subscriber):
    _complete(server, PROMPT)
    assert server.wait_for(lambda s: s["num_cached_blocks"] > 0)["num_cached_blocks"] > 0
    _events(subscriber, lambda ev: False, timeout=0.5)  # drain what was published so far
    r = httpx.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 200
    stats = server.wait_for(lambda s: s["num_cached_blocks"] == 0)
    assert stats["num_cached_blocks"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    events = _events(subscriber, lambda ev: any(e["type"] == "AllBlocksCleared" for e in ev))
    removed = {h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
    assert set(block_hashes(PROMPT, BLOCK)) <= removed
    assert _complete(server, PROMPT)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_streaming_kv_requests_run_and_cache_apart(server):
    """heron's ``streaming_kv`` request field (StreamingLLM): accepted, cached apart from
    whole-context requests (their deep KV differs past the window), checked at the edge."""
    _complete(server, PROMPT)  # the whole-context request caches the prompt's blocks
    streaming = {"sink_tokens": 4, "window": 32}
    first = _complete(server, PROMPT, streaming_kv=streaming, max_tokens=40)
    assert first["usage"]["completion_tokens"] == 40
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = _complete(server, PROMPT, streaming_kv=streaming, max_tokens=40)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    for bad in ({"window": 0}, {"sink_tokens": 4}, {"window": 8, "extra": 1}):
        r = httpx.post(f"{server.url}/v1/completions",
                       json={"prompt": PROMPT, "streaming_kv": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("streaming_kv"), r.json()
