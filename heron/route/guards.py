"""Input guards: refuse what no worker should see, before any worker sees it.

Body size (counted as it arrives, so a chunked body cannot slip past), valid JSON object,
``n``, ``max_tokens`` / ``max_completion_tokens`` and the prompt length estimate, each limit
a flag. Refusals carry the same OpenAI error body as `heron serve`
(``heron.server.errors.error_body``). The prompt text extracted here is what policies see.
"""

from __future__ import annotations

import json

import msgspec
from starlette.requests import ClientDisconnect

from heron.route.admission import Refused
from heron.route.config import RouterConfig
from heron.route.policies.base import RouteRequest

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _bad(message: str, param: str | None = None, status: int = 400,
         reason: str = "invalid") -> Refused:
    return Refused(status, message, "invalid_request_error", reason, param=param)


async def read_body(receive, limit: int) -> bytes:
    """The request body from ASGI ``receive``, refused with 413 as soon as it passes
    ``limit`` bytes; raises ``ClientDisconnect`` if the client leaves first."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit and size > limit:
            raise _bad(f"request body larger than {limit} bytes", None, 413, "body_too_large")
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def parse_body(raw: bytes) -> dict:
    """The body as a dict, decoded once (msgspec: a few times faster than ``json``; what it
    refuses, e.g. NaN or integers past 64 bits, gets ``json``'s verdict and error message)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    return body


def prompt_text(endpoint: str, body: dict) -> str:
    """Completions: the prompt (a list of strings: its first; token ids: ""); chat: the
    text contents of the messages, joined with newlines."""
    if endpoint == "completions":
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        return prompt if isinstance(prompt, str) else ""
    parts = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # content parts: keep the text ones
            parts.extend(p.get("text", "") for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


def estimate_tokens(text: str) -> int:
    return len(text) // 4 + 1


def _int_field(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer", name)
    return value


def _check_limits(body: dict, prompt_tokens: int, config: RouterConfig) -> None:
    n = _int_field(body, "n")
    if n is not None and config.max_n and n > config.max_n:
        raise _bad(f"n={n} is over this router's limit of {config.max_n}", "n")
    for name in ("max_tokens", "max_completion_tokens"):
        value = _int_field(body, name)
        if value is not None and config.max_tokens_limit and value > config.max_tokens_limit:
            raise _bad(f"{name}={value} is over this router's limit of "
                       f"{config.max_tokens_limit}", name)
    if config.max_prompt_tokens and prompt_tokens > config.max_prompt_tokens:
        raise _bad(f"the prompt is about {prompt_tokens} tokens, over this router's limit of "
                   f"{config.max_prompt_tokens}", "prompt", 400, "prompt_too_long")


def all_prompts_tokens(endpoint: str, body: dict) -> int:
    """The estimate over every prompt of a batched completion (a guard must see them all)."""
    prompt = body.get("prompt") if endpoint == "completions" else None
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return sum(estimate_tokens(p) for p in prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return estimate_tokens(prompt_text(endpoint, body))


def route_request(endpoint: str, raw: bytes, config: RouterConfig) -> RouteRequest:
    """Parse and check a request body; raises :class:`Refused` (400) when a guard trips."""
    body = parse_body(raw)
    if endpoint == "chat" and not isinstance(body.get("messages"), list):
        raise _bad("messages must be a list", "messages")
    text = prompt_text(endpoint, body)
    _check_limits(body, all_prompts_tokens(endpoint, body), config)
    salt = body.get("cache_salt")
    return RouteRequest(endpoint=endpoint, body=body, text=text,
                        cache_salt=salt if isinstance(salt, str) else None,
                        prompt_tokens=estimate_tokens(text))
