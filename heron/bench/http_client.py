"""One benchmark request to an OpenAI-compatible endpoint, timed chunk by chunk.

Works with any server that speaks the OpenAI completions or chat-completions API (heron,
vLLM, llama.cpp's server, hosted APIs). Streaming responses are read as server-sent events;
a chunk "carries output" if it has text (completions) or delta content (chat). Token counts
come from the ``usage`` the server reports (asked for with ``stream_options``); a server that
reports none is counted one token per output chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from heron.bench.metrics import RequestRecord
from heron.bench.workloads import Sample

ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: ``api_base`` ends in /v1; ``root`` serves /metrics."""

    api_base: str
    root: str
    kind: str = "completions"
    model: str | None = None
    api_key: str | None = None
    stream: bool = True
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)

    @classmethod
    def from_url(cls, url: str, **kw) -> "Endpoint":
        """'http://host:8000' or 'http://host:8000/v1' (any path ending in /v1)."""
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"bad --url {url!r}: use http(s)://HOST:PORT[/v1]")
        base = url.rstrip("/")
        root = base.removesuffix("/v1")
        if kw.get("kind", "completions") not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {ENDPOINTS}")
        return cls(api_base=root + "/v1", root=root, **kw)

    @property
    def path(self) -> str:
        return self.api_base + ("/completions" if self.kind == "completions"
                                else "/chat/completions")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, sample: Sample) -> dict:
        """The JSON body for one sample: greedy, ``max_tokens`` = its output length."""
        body = {"model": self.model, "max_tokens": sample.output_len, "temperature": 0.0,
                "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.kind == "chat":
            if not isinstance(sample.prompt, str):
                raise ValueError("the chat endpoint needs text prompts")
            body["messages"] = [{"role": "user", "content": sample.prompt}]
        else:
            body["prompt"] = sample.prompt
        return {k: v for k, v in body.items() if v is not None} | self.extra_body


def _chunk_text(kind: str, msg: dict) -> str:
    choices = msg.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if kind == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or choice.get("message") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _apply_usage(record: RequestRecord, msg: dict) -> None:
    usage = msg.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens") or record.prompt_tokens
        record.output_tokens = usage.get("completion_tokens") or record.output_tokens


def _seconds(header: str | None) -> float | None:
    """A Retry-After given in seconds (an HTTP date is not worth parsing here)."""
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None


async def _read_stream(resp, endpoint: Endpoint, record: RequestRecord, start: float) -> None:
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        msg, now = json.loads(data), time.perf_counter()
        if msg.get("error"):
            raise RuntimeError(f"error in stream: {str(msg['error'])[:200]}")
        _apply_usage(record, msg)
        if _chunk_text(endpoint.kind, msg):
            record.chunks.append(now - start)
    if not done:
        raise RuntimeError("stream ended without [DONE]")


async def send(client, endpoint: Endpoint, sample: Sample, timeout: float) -> RequestRecord:
    """Send one request and time it; never raises (failures are recorded in the result)."""
    record, start = RequestRecord(), time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", endpoint.path, json=endpoint.body(sample),
                                     headers=endpoint.headers) as resp:
                record.status = resp.status_code
                if resp.status_code != 200:
                    record.retry_after = _seconds(resp.headers.get("retry-after"))
                    text = (await resp.aread()).decode(errors="replace")
                    raise RuntimeError(f"HTTP {resp.status_code}: {text[:200]}")
                if endpoint.stream:
                    await _read_stream(resp, endpoint, record, start)
                else:
                    msg = json.loads(await resp.aread())
                    _apply_usage(record, msg)
                    if _chunk_text(endpoint.kind, msg):
                        record.chunks.append(time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - timeouts, resets, bad JSON: a failed request
        record.error = f"{type(exc).__name__}: {exc}"[:300] if str(exc) else type(exc).__name__
    record.e2e = time.perf_counter() - start
    if record.chunks:
        record.ttft = record.chunks[0]
    if not record.output_tokens:
        record.output_tokens = len(record.chunks)
    return record
