"""`heron route` in front of two tiny-model workers: what comes back through the router is
what one worker answers (greedy: token-identical, streamed and not, both endpoints, n > 1,
logprobs), the OpenAI SDK works unchanged, round robin alternates, /v1/models, auth, guards,
and the admin /workers routes."""

from __future__ import annotations

import json

import httpx
import pytest

KEY = "sk-router-test"
ADMIN = {"Authorization": f"Bearer {KEY}"}
VOLATILE = ("id", "created", "system_fingerprint", "prompt_tokens_details")  # cache hits differ


@pytest.fixture(scope="module")
def router(workers, router_process):
    """One router for the module (round robin, the API key set)."""
    r = router_process("--worker-urls", *workers.urls, "--api-key", KEY,
                      "--max-tokens-limit", "512", "--max-n", "8")
    yield r
    assert r.stop() == 0, r.log_tail()


def _strip(obj):
    """A response without the fields that differ between two servers' answers."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _same(a, b, tol: float = 1e-4) -> bool:
    """Equal, floats within ``tol`` (logprobs move in the last digits when a prompt's KV
    comes from the prefix cache)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, tol) for x, y in zip(a, b))
    return a == b


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def _stream(url: str, path: str, body: dict, headers: dict | None = None) -> dict:
    """A streamed answer, per choice index (its events in order: choices of n > 1 interleave
    differently from run to run), plus the usage event and whether [DONE] came last."""
    per_choice: dict[int, list] = {}
    usage, last = None, None
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last == "[DONE]":
                continue
            event = _strip(json.loads(last))
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                per_choice.setdefault(choice["index"], []).append(choice)
    return {"choices": per_choice, "usage": usage, "done": last == "[DONE]"}


CASES = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12,
                         "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": ["Once upon a time", "Hello"], "max_tokens": 8,
                         "temperature": 0, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi there"}],
                              "max_tokens": 10, "temperature": 0, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count"}],
                              "max_tokens": 6, "temperature": 0, "n": 3}),
]


@pytest.mark.parametrize("path,body", CASES)
def test_greedy_outputs_match_one_worker(router, workers, path, body):
    body = {"model": "tiny", **body}
    direct = _post(workers.urls[0], path, body)
    assert direct.status_code == 200, direct.text
    for _ in range(2):  # round robin: once on each worker
        routed = _post(router.url, path, body, ADMIN)
        assert routed.status_code == 200, routed.text
        assert _same(_strip(routed.json()), _strip(direct.json())), (routed.json(),
                                                                     direct.json())
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    direct_stream = _stream(workers.urls[0], path, streamed)
    for _ in range(2):
        assert _same(_stream(router.url, path, streamed, ADMIN), direct_stream)
    assert direct_stream["done"] and direct_stream["usage"]


def test_openai_sdk_works_unchanged(router):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY, max_retries=0,
                           timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                    temperature=0)
    assert out.usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in chat if c.choices]
    assert len("".join(pieces)) > 0
    bad = openai.OpenAI(base_url=f"{router.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_round_robin_alternates(router, workers, metric_value):
    before = router.metrics()
    for _ in range(6):
        r = _post(router.url, "/v1/completions",
                  {"model": "tiny", "prompt": "x", "max_tokens": 1}, ADMIN)
        assert r.status_code == 200
    after = router.metrics()
    name = "heron_router:requests_total"
    counts = [metric_value(after, name, worker=u, route="/v1/completions")
              - metric_value(before, name, worker=u, route="/v1/completions")
              for u in workers.urls]
    assert counts == [3, 3]
    assert metric_value(after, "heron_router:routing_decisions_total",
                        policy="round_robin", reason="round_robin") >= 6


def test_auth_guards_and_errors_have_openai_shape(router):
    open_paths = [httpx.get(f"{router.url}{p}", timeout=5) for p in ("/health", "/ready",
                                                                    "/metrics")]
    assert [r.status_code for r in open_paths] == [200, 200, 200]
    for resp in (_post(router.url, "/v1/completions", {"prompt": "x"}),
                 httpx.get(f"{router.url}/workers", timeout=5)):
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == 401
    refusals = [({"prompt": "x", "n": 9}, "n"), ({"prompt": "x", "max_tokens": 513},
                                                   "max_tokens")]
    for body, param in refusals:
        resp = _post(router.url, "/v1/completions", body, ADMIN)
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error"
    resp = httpx.post(f"{router.url}/v1/completions", content=b"{not json",
                      headers={**ADMIN, "content-type": "application/json"}, timeout=5)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    # a worker's own 4xx passes through as it is (no retry)
    resp = _post(router.url, "/v1/completions", {"model": "nope", "prompt": "x"}, ADMIN)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"


def test_admin_adds_and_removes_workers(router, workers):
    listed = router.workers(ADMIN)
    assert sorted(w["url"] for w in listed) == sorted(workers.urls)
    assert all(w["healthy"] and w["breaker"] == "closed" for w in listed)
    url = workers.urls[1]
    gone = httpx.delete(f"{router.url}/workers", params={"url": url}, headers=ADMIN, timeout=5)
    assert gone.status_code == 200
    assert [w["url"] for w in router.workers(ADMIN)] == [workers.urls[0]]
    assert httpx.delete(f"{router.url}/workers", params={"url": url}, headers=ADMIN,
                        timeout=5).status_code == 404
    added = httpx.post(f"{router.url}/workers", json={"url": url}, headers=ADMIN, timeout=5)
    assert added.status_code == 201
    assert httpx.post(f"{router.url}/workers", json={"url": "ftp://x"}, headers=ADMIN,
                      timeout=5).status_code == 400
    assert sorted(w["url"] for w in router.workers(ADMIN)) == sorted(workers.urls)
