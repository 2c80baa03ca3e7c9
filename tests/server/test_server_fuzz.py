"""Property-based request fuzzing against a live `heron serve`, and schemathesis on its OpenAPI
document.

The fuzzer draws completion and chat bodies biased toward values that pass the JSON layer but
probe the edges: huge and negative integers, out-of-vocabulary ids in every id field, NaN and
infinities, lone surrogates, empty and huge lists, combinations of min_tokens / stop / n /
logprobs / echo / seeds / streaming. Every answer must be 200, 400, 413 or 429 in OpenAI's
shape (a stream: ending in [DONE], never in an error event), and after the run the engine is
alive with every KV block and admission slot free. Bounded: a few hundred requests on a tiny
model with a 64-token context.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


VOCAB = 49152
MAX_MODEL_LEN = 64
ALLOWED = {200, 400, 413, 429}

EDGE_INTS = [0, 1, -1, 2, 3, 16, 63, 64, 65, 128, 129, VOCAB - 1, VOCAB, 10**9, 2**31 - 1,
             2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**63 - 1, 2**70, -2**70]
EDGE_FLOATS = [0.0, -0.0, 1e-45, 1e-300, 1e-5, 0.5, 1.0, 2.0, 2.0000001, -2.0, 100.0, 1e308,
               float("nan"), float("inf"), float("-inf")]
EDGE_TEXT = ["", "Hi", "Hi \ud800", "\udc00", "\U0001F600 emoji", "<|im_end|>", "x" * 300,
             "\x00", "stop", "\n\n"]


def _ints():
    return st.one_of(st.sampled_from(EDGE_INTS), st.integers(-5, 70))


def _floats():
    return st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(-3, 3))


def _text():
    return st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=20))


def _token_ids():
    return st.one_of(st.lists(_ints(), max_size=6), st.lists(st.integers(0, VOCAB - 1),
                                                             min_size=1, max_size=40))


def _anything():
    """A value of the wrong type for most fields."""
    return st.one_of(st.none(), st.booleans(), _ints(), _floats(), _text(),
                     st.lists(_ints(), max_size=3), st.just({"a": 1}))


COMMON = {
    "max_tokens": st.one_of(st.sampled_from([1, 2, 4, 8, None]), _ints()),
    "min_tokens": _ints(), "n": st.one_of(st.sampled_from([1, 2, 3]), _ints()),
    "temperature": _floats(), "top_p": _floats(), "top_k": _ints(), "min_p": _floats(),
    "repetition_penalty": _floats(), "presence_penalty": _floats(),
    "frequency_penalty": _floats(), "seed": _ints(),
    "stop": st.one_of(_text(), st.lists(_text(), max_size=20)),
    "stop_token_ids": _token_ids(), "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.just({"include_usage": True})),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "cache_salt": st.one_of(st.none(), _text()), "user": _text(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "best_of": _ints(), "logit_bias": st.just({"5": 1}), "some_future_field": _anything(),
}
COMPLETION = {
    **COMMON,
    "prompt": st.one_of(_text(), st.lists(_text(), max_size=3), _token_ids(),
                        st.lists(_token_ids(), max_size=3), st.just([1] * 5000), _anything()),
    "logprobs": st.one_of(st.sampled_from([None, 0, 1, 5]), _ints()), "echo": st.booleans(),
}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                 "content": st.one_of(_text(), st.none(), st.just([
                                     {"type": "text", "text": "hi"}]), _anything())})
CHAT = {
    **COMMON,
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), _anything()),
    "logprobs": st.booleans(), "top_logprobs": st.one_of(st.none(), _ints()),
    "max_completion_tokens": st.one_of(st.none(), _ints()),
}


def _body(fields: dict) -> st.SearchStrategy:
    """A subset of ``fields`` with drawn values (the required field present most times)."""
    names = sorted(fields)
    return st.lists(st.sampled_from(names), max_size=8, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({n: fields[n] for n in chosen}))


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"),
              st.tuples(_body(COMPLETION), COMPLETION["prompt"]).map(
                  lambda bp: {"prompt": bp[1], **bp[0]})),
    st.tuples(st.just("/v1/chat/completions"),
              st.tuples(_body(CHAT), st.lists(MESSAGE, min_size=1, max_size=2)).map(
                  lambda bm: {"messages": bm[1], **bm[0]})),
)


@pytest.fixture(scope="module")
def server_args(served_model):
    return (served_model, "--max-model-len", str(MAX_MODEL_LEN), "--max-queued-requests", "4",
            "--max-sequences-per-request", "16", "--max-body-bytes", str(64 * 1024))


def _check_response(r: httpx.Response, body: dict, events: list[str] | None) -> None:
    assert r.status_code in ALLOWED, (r.status_code, body, r.text[:500])
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and error["type"] and error["code"] == r.status_code
        return
    if events is None:
        payload = r.json()
        assert payload["choices"] and "usage" in payload
        return
    data = [e[len("data: "):] for e in events if e.startswith("data: ")]
    assert data and data[-1] == "[DONE]", (body, data[-3:])
    assert not any('"error"' in d and d.startswith('{"error"') for d in data), (body, data)


def _send(client: httpx.Client, path: str, body: dict) -> None:
    raw = json.dumps(body)  # ensure_ascii: lone surrogates travel as \\udXXX escapes
    headers = {"content-type": "application/json"}
    if body.get("stream") is True:
        with client.stream("POST", path, content=raw, headers=headers) as r:
            if r.status_code == 200:
                events = list(r.iter_lines())
            else:
                r.read()
                events = None
            _check_response(r, body, events)
    else:
        _check_response(client.post(path, content=raw, headers=headers), body, None)


def test_fuzzed_requests_get_clear_answers_and_leave_nothing_behind(server):
    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=60) as client:

        @settings(max_examples=300, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(REQUESTS)
        def fuzz(request):
            if time.monotonic() - started > 150:
                return  # time budget spent: the remaining examples pass untested
            _send(client, *request)

        fuzz()
    assert httpx.get(f"{server.url}/health").status_code == 200
    stats = server.wait_for(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0
                            and s["admitted_requests"] == 0, timeout=30)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert (stats["admitted_requests"], stats["admitted_sequences"]) == (0, 0)


def test_schemathesis_finds_no_nonconformance(server):
    """Generated requests from /openapi.json: no 5xx, documented statuses, content types,
    headers and response bodies that match their schemas; invalid data is rejected."""
    checks = ("not_a_server_error,status_code_conformance,content_type_conformance,"
              "response_headers_conformance,response_schema_conformance,"
              "negative_data_rejection")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
           "--checks", checks, "--max-examples", "20", "--request-timeout", "30",
           "--seed", "1", "--workers", "1", "--phases", "examples,coverage,fuzzing",
           "--max-time", "60", "--suppress-health-check", "all"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert httpx.get(f"{server.url}/health").status_code == 200
