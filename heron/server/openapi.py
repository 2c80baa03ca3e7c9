"""The OpenAPI document says what the server really answers.

Routes parse their own bodies (strict JSON, see ``protocol.parse_request``), so FastAPI knows
neither their request schemas nor that it never sends 422: this module declares each body,
adds the OpenAI error shape for every status a route can answer, and marks the 200 of the
generation routes as JSON or an SSE stream.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from heron.server.responses import ErrorResponse

_ERRORS = {
    400: "invalid request (OpenAI error shape; `param` names the field)",
    401: "missing or wrong API key",
    404: "the model named in the request is not served here",
    408: "the request body did not arrive in time",
    413: "request body too large",
    415: "not application/json, or a compressed request body",
    429: "too many requests queued (see Retry-After)",
    500: "the engine failed this request",
    503: "shutting down, or the engine is not running",
}
_REF = "#/components/schemas/{model}"


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: the given statuses, each with the OpenAI error body."""
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra=`` declaring a required JSON request body of ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


# One server-sent event: `data` holds a JSON chunk, an error body, or "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
SSE_OR_JSON = {"content": {"text/event-stream": {"schema": _SSE_EVENT}},
               "description": "the response; with `stream: true` a stream of server-sent events"}


def install_openapi(app: FastAPI, body_models: list[type[BaseModel]]) -> None:
    """Replace ``app.openapi`` with a document that also holds ``body_models``' schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in body_models],
                                         ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
