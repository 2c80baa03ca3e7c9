"""The committed half of a request: one attempt's bookkeeping, and a streamed response relayed
chunk by chunk once its first chunk went out (after which nothing is retried).

A relayed stream that breaks, or whose worker is aborted as unhealthy, ends with an OpenAI-style
error event and ``data: [DONE]``; a client that leaves closes the upstream response, so the
worker sees the disconnect and aborts the request. However the response ends, the attempt is
finished exactly once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from heron.route.asgi import until_disconnect
from heron.route.metrics import RouterMetrics, UsageScanner
from heron.route.policies.base import RouteRequest
from heron.route.upstream import UpstreamError, UpstreamResponse, failure_reason
from heron.route.workers import WorkerState

logger = logging.getLogger("heron.route")


@dataclass(eq=False)  # hashed by identity: it sits in its worker's in_flight set
class Attempt:
    """One dispatch of a request to one worker; ``finish`` undoes its bookkeeping once.

    ``abort`` (the health checker, when the worker turns unhealthy) marks it aborted and, if
    its task is waiting on the worker right now (``waiting``), cancels that task, which calls
    ``take_abort`` on the CancelledError to tell an abort (retry elsewhere, or end the stream
    with an error event) from a client that left. A relay busy writing to its client is never
    cancelled: it sees ``aborted`` once the write is done.
    """

    worker: WorkerState
    request: RouteRequest
    done: bool = False
    aborted: bool = False
    task: asyncio.Task | None = None  # the task that waits on the worker
    waiting: bool = True  # the task is awaiting the worker now (not the client)

    def start(self) -> None:
        self.worker.outstanding_requests += 1
        self.worker.outstanding_tokens += self.request.prompt_tokens
        self.worker.in_flight.add(self)
        self.task = asyncio.current_task()

    def abort(self) -> None:
        if not self.done and not self.aborted:
            self.aborted = True
            if self.task is not None and self.waiting:
                self.task.cancel()

    def take_abort(self) -> bool:
        """In an ``except CancelledError``: True if the cancellation came from ``abort`` (it
        is then withdrawn, so the task goes on)."""
        if self.aborted and self.task is asyncio.current_task():
            self.task.uncancel()
            return True
        return False

    def finish(self, verdict: str) -> None:
        """verdict: "success", "failure" (breaker counts it) or "none" (no verdict)."""
        if self.done:
            return
        self.done = True
        self.worker.in_flight.discard(self)
        self.worker.outstanding_requests -= 1
        self.worker.outstanding_tokens -= self.request.prompt_tokens
        breaker = self.worker.breaker
        {"success": breaker.record_success, "failure": breaker.record_failure,
         "none": breaker.release}[verdict]()


def error_event(message: str, type_: str = "upstream_error", code: int = 502) -> bytes:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def relay(metrics: RouterMetrics, timeout_s: float, path: str, request: RouteRequest,
                attempt: Attempt, resp: UpstreamResponse, chunks, first: bytes, t0: float):
    """The streamed body: the first chunk, then the rest as it arrives. A failure ends
    the stream with an error event; a client that leaves closes the upstream response
    (the worker sees the disconnect and aborts the request)."""
    url, verdict, status = attempt.worker.url, "none", "200"
    usage = UsageScanner()
    deadline = t0 + timeout_s
    attempt.task, attempt.waiting = asyncio.current_task(), False
    try:
        metrics.ttfb.labels(path).observe(time.monotonic() - t0)
        usage.feed(first)
        yield first
        while not attempt.aborted:
            attempt.waiting = True  # only while awaiting the worker may an abort cancel us
            try:
                chunk = await anext(chunks, None)
            finally:
                attempt.waiting = False
            if chunk is None:
                break
            usage.feed(chunk)
            yield chunk
            if time.monotonic() > deadline:
                raise asyncio.TimeoutError
        if attempt.aborted:  # marked while this task wrote to the client
            raise asyncio.CancelledError
        verdict = "success"
    except (UpstreamError, asyncio.TimeoutError, asyncio.CancelledError) as exc:
        if isinstance(exc, asyncio.CancelledError) and not attempt.aborted:
            raise  # the client left
        attempt.take_abort()  # withdraws the abort's cancellation, if it made one
        reason = "unhealthy" if attempt.aborted else failure_reason(exc)
        verdict, status = "failure", "stream_error"
        metrics.errors.labels(path, url, "stream_" + reason).inc()
        logger.warning("stream from %s broke after its first byte: %s", url, reason)
        yield error_event(f"the worker's stream broke ({reason})")
    finally:
        close_quietly(resp)
        attempt.finish("failure" if attempt.aborted else verdict)
        metrics.requests.labels(path, url, "client_closed" if verdict == "none"
                                else status).inc()
        metrics.latency.labels(path, url).observe(time.monotonic() - t0)
        if usage.usage:
            metrics.record_usage(request.body.get("model") or "", usage.usage)


class RelayResponse:
    """A streamed response (plain ASGI: no task group per response) that always cleans up:
    however the call ends (finished, client gone, cancelled before the body started), the
    relay generator is closed and the attempt finished, so no worker keeps a phantom
    outstanding request, then the ``on_close`` callbacks run. A client that leaves is noticed
    by a watcher on ``receive`` (``until_disconnect``), which cancels the stream."""

    def __init__(self, content, attempt: Attempt, upstream: UpstreamResponse,
                 status_code: int, headers: dict[str, str]) -> None:
        self.body_iterator = content
        self.status_code = status_code
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in headers.items()]
        self._attempt = attempt
        self._upstream = upstream
        self.on_close: list = []  # callables run once the response is over, however it ended

    async def __call__(self, scope, receive, send) -> None:
        try:
            await until_disconnect(self._stream(send), receive)
        finally:
            # nothing below suspends (relay's cleanup is synchronous): a pending
            # cancellation cannot cut it short
            await self.body_iterator.aclose()
            if not self._attempt.done:  # the body never started
                close_quietly(self._upstream)
                self._attempt.finish("none")
            for callback in self.on_close:
                callback()

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def close_quietly(resp: UpstreamResponse | None) -> None:
    """Close a response that may not exist (synchronous: it cannot be interrupted)."""
    if resp is not None:
        resp.close()
