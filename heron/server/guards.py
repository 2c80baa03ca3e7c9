"""The outermost ASGI middleware: request framing, auth, OPTIONS and HEAD, draining, engine
liveness, the JSON content type of POSTs, body limits and timeout, last-resort 500.

A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware
wraps ``receive`` so the route never sees ``http.disconnect`` (a non-streaming request whose
client left would run to the end). Here the body is read once, counting the bytes that really
arrive (a chunked body has no Content-Length to trust), then replayed to the app, after which
``receive`` is the server's own, so ``Request.is_disconnected()`` works.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import logging

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from heron.server.errors import error_body
from heron.server.http_rules import allowed_methods, csrf_refusal, framing_error

logger = logging.getLogger("heron.server")

# Paths anyone may call, also when an API key is set (probes, scrapers).
OPEN_PATHS = frozenset({"/health", "/ready", "/version", "/metrics"})
# Probes that answer 503 (with Retry-After) while the server drains.
PROBE_PATHS = ("/health", "/ready")
# Paths that need a live engine and a server that is not draining.
ENGINE_PATH_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/reset_prefix_cache")
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def error_response(status: int, message: str, type_: str, param=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, status), status_code=status,
                        headers=headers)


def draining_response(settings) -> JSONResponse:
    """503 while shutting down; Retry-After: the grace period (at least 1 s), after which this
    server is gone and a replacement may be there."""
    retry = max(1, math.ceil(settings.shutdown_timeout))
    return error_response(503, "the server is shutting down", "service_unavailable",
                          headers={"Retry-After": str(retry)})


def api_key_matches(authorization: str | None, key: str) -> bool:
    """``Authorization: Bearer KEY`` (scheme case-insensitive), compared in constant time."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


class GuardMiddleware:
    """Refuses what must not reach a route, and turns an unhandled exception into a JSON 500
    (if the response has not started; otherwise the connection is closed)."""

    def __init__(self, app: ASGIApp, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "HEAD":  # a GET without its body (RFC 9110 section 9.3.2)
            scope, send = {**scope, "method": "GET"}, _without_body(send)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None and scope["method"] in BODY_METHODS:
                body, refusal = await self._read_body(scope, receive)
                if body is None and refusal is None:
                    return  # the client left before sending its body
                receive = _replay(body, receive)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001 - the last line of defence
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:
                await error_response(500, "internal server error", "server_error",
                                     headers={"Connection": "close"})(scope, receive, send)

    def _refusal(self, scope: Scope) -> Response | None:
        """What to answer instead of the route, or None to route the request."""
        path, headers = _route_path(scope), _headers(scope)
        if (framing := framing_error(scope["headers"])) is not None:
            return error_response(400, framing, "invalid_request_error",
                                  headers={"Connection": "close"})
        key = self.state.settings.api_key
        if key and path not in OPEN_PATHS and not api_key_matches(headers.get("authorization"),
                                                                  key):
            return error_response(401, "invalid or missing API key", "authentication_error")
        if scope["method"] == "OPTIONS":  # a CORS preflight never gets here: CORS answers it
            return _options(scope)
        if self.state.draining and (path in PROBE_PATHS or path.startswith(ENGINE_PATH_PREFIXES)):
            return draining_response(self.state.settings)
        if path.startswith(ENGINE_PATH_PREFIXES):
            if not self.state.client.is_alive():
                return error_response(503, "the engine is not running", "service_unavailable")
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            return error_response(415, f"unsupported Content-Encoding {encoding!r}: send the "
                                  f"body uncompressed", "invalid_request_error")
        if scope["method"] in BODY_METHODS:
            has_body = "transfer-encoding" in headers or headers.get(
                "content-length", "0").strip() not in ("", "0")
            if (reason := csrf_refusal(headers, has_body)) is not None:
                return error_response(415, reason, "invalid_request_error")
        return None

    async def _read_body(self, scope: Scope, receive: Receive
                         ) -> tuple[bytes | None, JSONResponse | None]:
        """(body, None), or (None, a 413 / 400 to send), or (None, None) on disconnect."""
        limit = self.state.settings.max_body_bytes
        length = _headers(scope).get("content-length")
        if length is not None and not length.strip().isdigit():
            return None, error_response(400, "invalid Content-Length", "invalid_request_error")
        if length is not None and int(length) > limit:
            return None, self._too_large(limit)
        chunks, size = [], 0
        timeout = self.state.settings.http.body_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:  # a body trickled in byte by byte must not hold a connection for ever
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                self.state.metrics.record_rejection("408")
                return None, error_response(
                    408, f"the request body did not arrive within {timeout:g} s",
                    "invalid_request_error", headers={"Connection": "close"})
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None, self._too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    def _too_large(self, limit: int) -> JSONResponse:
        self.state.metrics.record_rejection("413")
        return error_response(413, f"request body over {limit} bytes", "invalid_request_error",
                              headers={"Connection": "close"})


def _options(scope: Scope) -> Response:
    """OPTIONS: 204 with the path's ``Allow``; 404 for a path heron does not serve."""
    methods = allowed_methods(scope["app"].routes, scope)
    if not methods:
        return error_response(404, not_served_message("OPTIONS", scope["path"]),
                              "invalid_request_error")
    return Response(status_code=204, headers={"Allow": ", ".join(methods)})


SERVED = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /tokenize, "
          "POST /detokenize, GET /health, GET /ready, GET /metrics, GET /stats, GET /version, "
          "GET /server_info, GET /model_info, POST /reset_prefix_cache")


def not_served_message(method: str, path: str) -> str:
    """The 404 message of a path heron does not serve (/v1/embeddings, /v1/responses, ...)."""
    return f"{method} {path} is not served here; heron serves {SERVED}"


def _route_path(scope: Scope) -> str:
    """The path the routes see: behind ``--root-path`` a proxy may or may not strip it."""
    root, path = scope.get("root_path", ""), scope["path"]
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


def _without_body(send: Send) -> Send:
    """A ``send`` that drops the body (HEAD), keeping the headers (Content-Length included)."""

    async def bodyless(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return bodyless


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then the server's own messages."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
