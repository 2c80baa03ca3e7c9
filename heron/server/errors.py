"""OpenAI-style error bodies and the exception the protocol layer raises for bad requests."""

from __future__ import annotations

from typing import Any

INVALID_REQUEST = "invalid_request_error"


class RequestValidationError(Exception):
    """A request the server refuses with HTTP 400 and an OpenAI error body.

    Not to be confused with ``fastapi.exceptions.RequestValidationError`` (pydantic failures,
    422 by default); convert those with :func:`pydantic_error_message` to answer 400 as well.
    """

    status_code = 400

    def __init__(self, message: str, param: str | None = None,
                 type: str = INVALID_REQUEST) -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.message = message
        self.param = param
        self.type = type

    def to_body(self) -> dict[str, Any]:
        """The JSON body to send: ``{"error": {...}}``."""
        return error_body(self.message, self.type, self.param, self.status_code)


class ModelNotFoundError(RequestValidationError):
    """A request for a model this server does not serve: vLLM's 404 (clients that route
    between servers rely on it)."""

    status_code = 404

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", "model", "NotFoundError")


def error_body(message: str, type: str = INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
               param: str | None = None, code: int | str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def pydantic_error_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Summarise pydantic's ``exc.errors()`` as (message, param) for an OpenAI 400 body.

    ``param`` is the top-level request field of the first error; the message lists every
    error as ``field.path: reason``.
    """
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) or "request"
        parts.append(f"{where}: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request", param
