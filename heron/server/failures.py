"""How a request's failure reaches its client, the same way in a JSON response and at the end
of an SSE stream: (HTTP status, message, OpenAI error type)."""

from __future__ import annotations

from heron.transport.async_client import EngineDeadError, RequestAbortedError, \
    RequestFailedError
from heron.server.errors import INVALID_REQUEST

# What the handlers answer for: the engine refused the request (ValueError), failed it while
# processing it, or is gone; or the server aborted it (shutting down, its grace ran out).
FAILURES = (ValueError, RequestFailedError, EngineDeadError, RequestAbortedError)


def classify(exc: BaseException) -> tuple[int, str, str]:
    """(status, message, type) for ``exc``; anything unexpected is our bug: a bare 500."""
    if isinstance(exc, RequestFailedError):
        return 500, f"the engine failed this request: {exc}", "server_error"
    if isinstance(exc, RequestAbortedError):
        return 503, str(exc), "service_unavailable"
    if isinstance(exc, EngineDeadError):
        return 503, f"the engine is not running: {exc}", "service_unavailable"
    if isinstance(exc, ValueError):
        return 400, str(exc), INVALID_REQUEST
    return 500, "internal server error", "server_error"
