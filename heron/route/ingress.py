"""The forwarding path, POST /v1/completions and /v1/chat/completions, as plain ASGI.

A request goes: auth -> body guard -> input guards -> admission -> policy -> proxy, and a
client that leaves before its response started cancels the upstream request. The router app
(``app.RouterApp``) sends these two routes here before FastAPI's middleware, routing and
dependency machinery, which cost more per request than everything the router itself does
(the other routes, all cold, stay FastAPI routes). Refusals get OpenAI's error body, as they
would from the FastAPI handlers.
"""

from __future__ import annotations

import hmac
import logging
import time

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from heron.route.admission import Refused
from heron.route.asgi import until_disconnect
from heron.route.guards import ENDPOINTS, read_body, route_request
from heron.server.errors import error_body

logger = logging.getLogger("heron.route")
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(message, type_, param, status), status, headers=headers)


def unauthorized() -> JSONResponse:
    return error_response(401, "Incorrect API key provided.", "invalid_request_error")


def authorized(api_key: str | None, path: str, authorization: str | None) -> bool:
    """``--api-key``: ``Authorization: Bearer KEY`` (compared in constant time); the probes
    and /metrics stay open."""
    if not api_key or path in OPEN_PATHS:
        return True
    scheme, _, token = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode())


async def forward(state, scope, receive, send) -> None:
    """Answer one forwarded request on ``state`` (the app's ``RouterState``)."""
    t0, path = time.monotonic(), scope["path"]
    headers = Headers(scope=scope)
    if not authorized(state.config.api_key, path, headers.get("authorization")):
        await unauthorized()(scope, receive, send)
        return
    try:
        resp = await _respond(state, path, headers, receive, t0)
    except Refused as exc:
        state.metrics.rejected.labels(exc.reason).inc()
        resp = error_response(exc.status, exc.message, exc.type, exc.param, exc.retry_after_s)
    except Exception:
        logger.exception("unexpected error on %s", path)
        resp = error_response(500, "internal router error", "internal_server_error")
    await resp(scope, receive, send)


async def _respond(state, path: str, headers: Headers, receive, t0: float) -> Response:
    """Guards, admission and the proxy; raises :class:`Refused`. The admission slot is given
    back when the response is ready, or for a stream once it ends."""
    cfg = state.config
    try:
        raw = await read_body(receive, cfg.max_body_bytes)
    except ClientDisconnect:
        return Response(status_code=499)  # gone before its body arrived
    route_req = route_request(ENDPOINTS[path], raw, cfg)
    queued_at = time.monotonic()
    await state.admission.acquire()
    queued_s = time.monotonic() - queued_at
    state.metrics.queue_wait.observe(queued_s)
    stream = bool(route_req.body.get("stream"))
    try:
        resp = await until_disconnect(
            state.proxy.forward(path, route_req, raw, headers, stream, t0 + queued_s), receive)
    except BaseException:
        state.admission.release()
        raise
    if hasattr(resp, "on_close"):  # a stream: the slot is held until it ends
        resp.on_close.append(state.admission.release)
    else:
        state.admission.release()
    return resp

