"""HTTP details of `heron serve`, in process (the app called as ASGI, no engine): HEAD and
OPTIONS, 405 with Allow, the JSON content type POSTs need (CSRF), ambiguous framing, a body
that trickles in, unknown paths and models, CORS off and on, --root-path, internal names kept
out of client errors."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

from heron.engine.stats import EngineStats
from heron.server.app import ServerSettings, build_app
from heron.server.failures import classify
from heron.server.settings import CorsOptions, HttpOptions, OpenAIOptions
from heron.transport.async_client import EngineDeadError, RequestFailedError


class FakeClient:
    """What the routes touched here need of an AsyncEngineClient; no generation."""

    model_name, max_model_len, vocab_size, pid = "/models/smol", 64, 100, 0

    def __init__(self) -> None:
        self.resets = 0

    def is_alive(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return EngineStats()

    def reset_prefix_cache(self) -> None:
        self.resets += 1


def make_app(**http):
    settings = ServerSettings("smol", openai=OpenAIOptions(model_aliases=("smol-alias",)),
                              http=HttpOptions(**http))
    client = FakeClient()
    return build_app(client, settings), client


async def _call(app, method: str, path: str, headers=(), chunks=(b"",), pause_s: float = 0.0):
    """One request; the body in ``chunks``, ``pause_s`` between them. (status, headers, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "server": ("127.0.0.1", 8000),
             "client": ("127.0.0.1", 5555),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    pending = list(chunks)
    sent: list[dict] = []

    async def receive():
        if not pending:
            await asyncio.sleep(3600)  # nothing more arrives; the server must not wait on it
        if pause_s and len(pending) < len(chunks):
            await asyncio.sleep(pause_s)
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 20)
    start = sent[0]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], headers, body


def call(app, method, path, headers=(), chunks=(b"",), pause_s=0.0):
    return asyncio.run(_call(app, method, path, headers, chunks, pause_s))


def _error(status: int, body: bytes, code: int) -> dict:
    assert status == code, body
    error = json.loads(body)["error"]
    assert error["message"] and error["type"] and error["code"] == code
    return error


JSON = [("content-type", "application/json")]


def test_head_answers_like_get_without_a_body():
    app, _ = make_app()
    status, headers, body = call(app, "GET", "/v1/models")
    head_status, head_headers, head_body = call(app, "HEAD", "/v1/models")
    assert (status, head_status) == (200, 200) and head_body == b""
    assert head_headers["content-length"] == headers["content-length"] == str(len(body))


def test_options_lists_the_methods_and_405_carries_allow():
    app, _ = make_app()
    status, headers, _ = call(app, "OPTIONS", "/v1/completions")
    assert status == 204 and headers["allow"] == "POST, OPTIONS"
    status, headers, _ = call(app, "OPTIONS", "/v1/models")
    assert status == 204 and headers["allow"] == "GET, HEAD, OPTIONS"
    _error(*call(app, "OPTIONS", "/v1/embeddings")[::2], 404)
    status, headers, body = call(app, "GET", "/v1/completions")
    assert "use POST" in _error(status, body, 405)["message"]
    assert headers["allow"] == "POST, OPTIONS"


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses",
                                  "/v1/audio/transcriptions", "/no/such/path"])
def test_unserved_paths_get_an_openai_404_saying_what_is_served(path):
    app, _ = make_app()
    status, _, body = call(app, "POST", path, JSON, [b"{}"])
    error = _error(status, body, 404)
    assert path in error["message"] and "POST /v1/chat/completions" in error["message"]


def test_a_model_not_served_is_vllms_404_and_every_served_name_is_listed():
    app, _ = make_app()
    body = json.dumps({"model": "not-smol", "prompt": "hi"}).encode()
    status, _, raw = call(app, "POST", "/v1/completions", JSON, [body])
    assert json.loads(raw) == {"error": {"message": "The model `not-smol` does not exist.",
                                         "type": "NotFoundError", "param": "model",
                                         "code": 404}}
    status, _, raw = call(app, "POST", "/tokenize", JSON,
                          [json.dumps({"model": "nope", "prompt": "x"}).encode()])
    assert _error(status, raw, 404)["param"] == "model"
    status, _, raw = call(app, "GET", "/v1/models")
    assert [m["id"] for m in json.loads(raw)["data"]] == ["smol", "smol-alias"]


@pytest.mark.parametrize("path,body", [("/v1/completions", b'{"prompt": "hi"}'),
                                       ("/v1/chat/completions", b'{"messages": []}'),
                                       ("/reset_prefix_cache", b"x"),
                                       ("/tokenize", b'{"prompt": "hi"}')])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_posts_that_a_web_page_could_send_are_refused(path, body, content_type):
    app, client = make_app()
    headers = [("content-length", str(len(body)))]
    if content_type is not None:
        headers.append(("content-type", content_type))
    status, _, raw = call(app, "POST", path, headers, [body])
    assert "application/json" in _error(status, raw, 415)["message"]
    assert client.resets == 0


def test_a_bodyless_post_needs_json_only_when_a_browser_sends_it():
    app, client = make_app()
    assert call(app, "POST", "/reset_prefix_cache")[0] == 200  # curl -X POST
    assert call(app, "POST", "/reset_prefix_cache", JSON)[0] == 200
    status, _, raw = call(app, "POST", "/reset_prefix_cache", [("origin", "https://evil.example")])
    _error(status, raw, 415)  # a page's fetch(..., {method: "POST", mode: "no-cors"})
    assert client.resets == 2


def test_content_length_with_chunked_is_refused_and_the_connection_closed():
    app, _ = make_app()
    headers = JSON + [("content-length", "5"), ("transfer-encoding", "chunked")]
    status, resp_headers, raw = call(app, "POST", "/v1/completions", headers, [b"{}"])
    _error(status, raw, 400)
    assert resp_headers["connection"] == "close"
    headers = JSON + [("content-length", "2"), ("content-length", "3")]
    _error(*call(app, "POST", "/v1/completions", headers, [b"{}"])[::2], 400)


def test_a_body_that_trickles_in_gets_408():
    app, _ = make_app(body_timeout_s=0.2)
    chunks = [b'{"prompt": "'] + [b"x"] * 1000
    status, headers, raw = call(app, "POST", "/v1/completions", JSON, chunks, pause_s=0.5)
    _error(status, raw, 408)
    assert headers["connection"] == "close"


def test_cors_is_off_unless_origins_are_given():
    preflight = [("origin", "https://ok.example"), ("access-control-request-method", "POST"),
                 ("access-control-request-headers", "content-type")]
    app, _ = make_app()
    status, headers, _ = call(app, "OPTIONS", "/v1/completions", preflight)
    assert "access-control-allow-origin" not in headers
    app, _ = make_app(cors=CorsOptions(("https://ok.example",)))
    status, headers, _ = call(app, "OPTIONS", "/v1/completions", preflight)
    assert status == 200 and headers["access-control-allow-origin"] == "https://ok.example"
    evil = [("origin", "https://evil.example")] + preflight[1:]
    status, headers, _ = call(app, "OPTIONS", "/v1/completions", evil)
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = call(app, "GET", "/v1/models", [("origin", "https://ok.example")])
    assert status == 200 and headers["access-control-allow-origin"] == "https://ok.example"


def test_root_path_and_disabled_docs():
    app, _ = make_app(root_path="/llm", docs=False)
    assert call(app, "GET", "/llm/v1/models")[0] == 200  # the proxy kept its prefix
    assert call(app, "GET", "/v1/models")[0] == 200  # the proxy stripped it
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert call(app, "GET", path)[0] == 404


def test_client_errors_carry_no_internal_class_names():
    status, message, _ = classify(EngineDeadError(
        "heron.errors.EngineFault: worker rank 0 exited (code -9)"))
    assert (status, message) == (503, "the engine is not running: worker rank 0 exited "
                                      "(code -9)")
    status, message, _ = classify(RequestFailedError("RuntimeError: boom"))
    assert (status, message) == (500, "the engine failed this request: boom")
    _, message, _ = classify(RequestFailedError("KeyError"))
    assert "Error" not in message


def test_request_log_line_follows_enable_log_requests():
    requests_log, heron_log = logging.getLogger("heron.server.requests"), logging.getLogger("heron")
    level = heron_log.level
    heron_log.setLevel(logging.INFO)  # as `heron serve` runs
    try:
        build_app(FakeClient(), ServerSettings("smol"))
        assert requests_log.isEnabledFor(logging.INFO)
        build_app(FakeClient(), ServerSettings("smol", openai=OpenAIOptions(log_requests=False)))
        assert not requests_log.isEnabledFor(logging.INFO)
    finally:
        heron_log.setLevel(level)
        requests_log.setLevel(logging.NOTSET)
