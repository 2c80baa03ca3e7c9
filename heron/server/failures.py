"""How a request's failure reaches its client, the same way in a JSON response and at the end
of an SSE stream: (HTTP status, message, OpenAI error type)."""

from __future__ import annotations

import re

from heron.errors import EngineDeadError, RequestAbortedError, RequestFailedError
from heron.server.errors import INVALID_REQUEST

# What the handlers answer for: the engine refused the request (ValueError), failed it while
# processing it, or is gone; or the server aborted it (shutting down, its grace ran out).
FAILURES = (ValueError, RequestFailedError, EngineDeadError, RequestAbortedError)


# Exception class names as traceback.format_exception_only writes them ("heron.errors.
# EngineFault: ", "RuntimeError: ", a bare "KeyError"): internals a client cannot act on, and
# that tell an attacker what runs here. The log keeps them.
_CLASS_NAME = re.compile(r"\b(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Fault|Interrupt|Exit)"
                         r"\b(?::\s*|\s*$)")


def public_message(text: str, fallback: str) -> str:
    """``text`` without exception class names (``fallback`` if nothing is left)."""
    cleaned = re.sub(r"\s{2,}", " ", _CLASS_NAME.sub("", str(text))).strip(" :")
    return cleaned or fallback


def classify(exc: BaseException) -> tuple[int, str, str]:
    """(status, message, type) for ``exc``; anything unexpected is our bug: a bare 500."""
    if isinstance(exc, RequestFailedError):
        detail = public_message(exc, "internal error")
        return 500, f"the engine failed this request: {detail}", "server_error"
    if isinstance(exc, RequestAbortedError):
        return 503, public_message(exc, "the request was aborted"), "service_unavailable"
    if isinstance(exc, EngineDeadError):
        detail = public_message(exc, "it stopped")
        return 503, f"the engine is not running: {detail}", "service_unavailable"
    if isinstance(exc, ValueError):
        return 400, public_message(exc, "invalid request"), INVALID_REQUEST
    return 500, "internal server error", "server_error"
