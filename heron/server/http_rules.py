"""HTTP rules the guard middleware applies before routing: which methods a path allows (for
``Allow``, OPTIONS and 405), request framing (RFC 9112), and the content type a POST must have
(the CSRF rule). Pure functions of the ASGI scope and the app's routes."""

from __future__ import annotations

from starlette.routing import Match
from starlette.types import Scope

JSON = "application/json"


def allowed_methods(routes, scope: Scope) -> list[str]:
    """The methods some route answers at ``scope``'s path (HEAD with GET, OPTIONS always);
    empty when no route has that path."""
    methods: set[str] = set()
    probe = {**scope, "type": "http", "method": "GET"}
    for route in routes:
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches(probe)[0] != Match.NONE:
            methods |= set(route_methods)
    if not methods:
        return []
    if "GET" in methods:
        methods.add("HEAD")
    methods.add("OPTIONS")
    order = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return sorted(methods, key=lambda m: order.index(m) if m in order else len(order))


def framing_error(raw_headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request's framing is ambiguous, or None. RFC 9112 section 6.3: a message with
    both Transfer-Encoding and Content-Length may be a request-smuggling attempt and must be
    refused (and the connection closed); so must several differing Content-Lengths."""
    names = [name.lower() for name, _ in raw_headers]
    lengths = {value.strip() for name, value in raw_headers if name.lower() == b"content-length"}
    if b"transfer-encoding" in names and b"content-length" in names:
        return "a request may not carry both Transfer-Encoding and Content-Length"
    if len(lengths) > 1:
        return "a request may not carry several different Content-Length headers"
    return None


def media_type(content_type: str | None) -> str:
    """``application/json; charset=utf-8`` -> ``application/json``."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def csrf_refusal(headers: dict[str, str], has_body: bool) -> str | None:
    """Why a POST must be refused with 415, or None.

    A browser sends a cross-origin POST without asking the server first (a CORS "simple
    request", which CORS cannot stop) only with a Content-Type of text/plain,
    application/x-www-form-urlencoded or multipart/form-data, or with no body and no
    Content-Type at all. Requiring application/json turns every browser POST into one that
    needs a preflight, which fails unless --allowed-origins lets that origin in. A POST with
    no body and no JSON type stays accepted only without an Origin header: browsers send
    Origin on every POST, so such a request comes from curl or a script (``curl -X POST
    .../reset_prefix_cache``), never from a web page the user happens to open."""
    if media_type(headers.get("content-type")) == JSON:
        return None
    if has_body or "origin" in headers:
        shown = media_type(headers.get("content-type")) or "none"
        return (f"Content-Type must be application/json (got {shown}): POST bodies are JSON, "
                f"and other types would let any web page send requests here")
    return None
