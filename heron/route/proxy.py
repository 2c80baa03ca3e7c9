"""Forwarding: pick a worker, send the request, retry elsewhere until the first byte has
reached the client, then pass the response through (``relay`` streams it chunk by chunk).

The commit point: a response is *committed* once its status line and first body chunk went to
the client. Before it, any failure (connection refused or reset, a timeout before the first
chunk, a 5xx or 429 from the worker) is retried on another worker with exponential backoff and
jitter, up to ``--retry-max-retries`` times. After it nothing is retried: a stream that breaks
ends with an OpenAI-style error event and ``data: [DONE]``, never silently.

Every attempt leaves its worker's counters as it found them (outstanding requests and tokens
back down) and gives its breaker exactly one verdict, whatever way it ends.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from starlette.responses import Response

from heron.route.admission import MAX_RETRY_AFTER_S, Refused, saturation_refusal
from heron.route.config import RouterConfig
from heron.route.metrics import RouterMetrics, usage_of
from heron.route.policies.base import Decision, Policy, RouteRequest
from heron.route.relay import Attempt, RelayResponse, close_quietly, relay
from heron.route.upstream import Upstream, UpstreamError, UpstreamResponse, failure_reason
from heron.route.workers import WorkerRegistry, WorkerState

logger = logging.getLogger("heron.route")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
PASSED_HEADERS = ("content-type", "x-request-id", "retry-after")


class RetryableFailure(Exception):
    """One attempt failed before anything reached the client."""

    def __init__(self, reason: str, response: tuple[int, bytes, dict] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason  # metric label: connect, timeout, read, status_5xx, status_429
        self.response = response  # the worker's answer (status, body, headers), if it gave one


class Proxy:
    """Sends requests to workers chosen by the policy. Stateless between requests apart from
    what it records on the workers, the breakers and the metrics."""

    def __init__(self, config: RouterConfig, workers: WorkerRegistry, policy: Policy,
                 metrics: RouterMetrics, upstream: Upstream) -> None:
        self.config = config
        self.workers = workers
        self.policy = policy
        self.metrics = metrics
        self.upstream = upstream
        self._rng = random.Random()

    def upstream_headers(self, client_headers) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if self.config.worker_api_key:
            headers["authorization"] = f"Bearer {self.config.worker_api_key}"
        elif not self.config.api_key and client_headers.get("authorization"):
            headers["authorization"] = client_headers["authorization"]  # transparent
        if client_headers.get("x-request-id"):
            headers["x-request-id"] = client_headers["x-request-id"]
        return headers

    def choose(self, request: RouteRequest, tried: set[str]) -> Decision:
        """The policy's pick among available, unsaturated workers (untried ones first);
        raises :class:`Refused` when there is none."""
        available = self.workers.available()
        if not available:
            waits = [w.breaker.retry_after_s() for w in self.workers.all() if w.healthy]
            raise Refused(503, "no worker is available", "service_unavailable", "no_worker",
                          max(1, int(min(waits, default=self.config.health_check_interval_secs))))
        now = time.monotonic()
        ready = [w for w in available if not w.saturated(self.config, now)]
        if not ready:
            raise saturation_refusal([w.saturated_until for w in available], [])
        fresh = [w for w in ready if w.url not in tried]
        decision = self.policy.pick(request, fresh or ready)
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        return decision

    def backoff_s(self, retry: int) -> float:
        cfg = self.config
        base = min(cfg.retry_max_backoff_ms,
                   cfg.retry_initial_backoff_ms * cfg.retry_backoff_multiplier ** retry)
        jitter = 1 + cfg.retry_jitter_factor * self._rng.uniform(-1, 1)
        return max(0.0, base * jitter) / 1000

    async def forward(self, path: str, request: RouteRequest, raw: bytes, client_headers,
                      stream: bool, t0: float) -> Response | RelayResponse:
        """Answer one request: retries until committed; raises :class:`Refused`."""
        headers = self.upstream_headers(client_headers)
        tried: set[str] = set()
        last: RetryableFailure | None = None
        for attempt_no in range(self.config.max_attempts):
            if attempt_no:
                self.metrics.retries.labels(path, last.reason).inc()
                await asyncio.sleep(self.backoff_s(attempt_no - 1))
            try:
                decision = self.choose(request, tried)
            except Refused:
                if last is None:
                    raise
                break  # nothing left to try: answer with the last failure
            if attempt_no == 0:
                self.metrics.overhead.observe(time.monotonic() - t0)
            tried.add(decision.worker.url)
            try:
                return await self._attempt(path, request, decision, raw, headers, stream, t0)
            except RetryableFailure as exc:
                self.metrics.errors.labels(path, decision.worker.url, exc.reason).inc()
                logger.info("attempt %d on %s failed (%s)", attempt_no + 1,
                            decision.worker.url, exc.reason)
                last = exc
        return self._exhausted(path, last)

    def _exhausted(self, path: str, last: RetryableFailure) -> Response:
        """Every try failed before committing: 429 if the workers were only saturated, the
        worker's own answer for a 5xx, else 502."""
        if last.reason == "status_429":
            raise saturation_refusal([w.saturated_until for w in self.workers.available()], [])
        if last.response is not None:
            status, body, headers = last.response
            self.metrics.requests.labels(path, "", str(status)).inc()
            return Response(body, status, headers=headers)
        raise Refused(502, f"no worker could answer the request (last failure: {last.reason})",
                      "upstream_error", "exhausted")

    async def _attempt(self, path: str, request: RouteRequest, decision: Decision, raw: bytes,
                       headers: dict, stream: bool, t0: float) -> Response | RelayResponse:
        worker = decision.worker
        worker.breaker.acquire()
        attempt = Attempt(worker, request)
        attempt.start()
        self.policy.on_routed(request, decision)
        self.metrics.routed_prompt.labels(worker.url).inc(request.prompt_tokens)
        if decision.predicted_hit_tokens:
            self.metrics.predicted_hit.labels(worker.url).inc(decision.predicted_hit_tokens)
        resp = None
        try:
            async with asyncio.timeout(self.config.request_timeout_secs):
                resp = await self.upstream.post(worker.url + path, raw, headers)
                await self._check_status(worker, resp, attempt)
                body = b"" if stream and resp.status == 200 else await resp.read()
        except asyncio.TimeoutError:
            close_quietly(resp)
            attempt.finish("failure")
            raise RetryableFailure("timeout") from None
        except RetryableFailure:
            close_quietly(resp)
            raise
        except UpstreamError as exc:
            close_quietly(resp)
            attempt.finish("failure")
            raise RetryableFailure(exc.reason) from None
        except BaseException as exc:  # cancelled: the worker went down, or the client left
            aborted = isinstance(exc, asyncio.CancelledError) and attempt.take_abort()
            close_quietly(resp)
            attempt.finish("failure" if aborted else "none")
            if aborted:
                raise RetryableFailure("unhealthy") from None
            raise
        if stream and resp.status == 200:
            return await self._commit_stream(path, request, attempt, resp, t0)
        close_quietly(resp)  # read to its end: the connection goes back to the pool
        return self._complete(path, request, attempt, resp, body, t0)

    async def _check_status(self, worker: WorkerState, resp: UpstreamResponse,
                            attempt: Attempt) -> None:
        """Raise RetryableFailure for a 429 or 5xx (after reading its small body)."""
        if resp.status not in RETRYABLE_STATUS:
            return
        body = await resp.read()
        kept = resp.picked_headers(PASSED_HEADERS)
        if resp.status == 429:
            rest = min(MAX_RETRY_AFTER_S, max(self.config.worker_429_cooldown_secs,
                                              _retry_after(resp)))
            worker.saturated_until = time.monotonic() + rest
            attempt.finish("none")  # backpressure, not breakage
            raise RetryableFailure("status_429", (resp.status, body, kept))
        attempt.finish("failure")
        raise RetryableFailure(f"status_{resp.status}", (resp.status, body, kept))

    def _complete(self, path: str, request: RouteRequest, attempt: Attempt,
                  resp: UpstreamResponse, body: bytes, t0: float) -> Response:
        attempt.finish("success")
        url = attempt.worker.url
        self.metrics.requests.labels(path, url, str(resp.status)).inc()
        self.metrics.latency.labels(path, url).observe(time.monotonic() - t0)
        self.metrics.ttfb.labels(path).observe(time.monotonic() - t0)
        if resp.status == 200 and b'"usage"' in body:
            usage = usage_of(body)
            if usage is not None:
                self.metrics.record_usage(request.body.get("model") or "", usage)
        return Response(body, resp.status, headers=resp.picked_headers(PASSED_HEADERS))

    async def _commit_stream(self, path: str, request: RouteRequest, attempt: Attempt,
                             resp: UpstreamResponse, t0: float) -> RelayResponse:
        """Wait for the first chunk (still retryable), then stream the rest through."""
        chunks = resp.chunks()
        try:
            async with asyncio.timeout(self.config.request_timeout_secs):
                first = await anext(chunks, b"")
        except BaseException as exc:
            aborted = isinstance(exc, asyncio.CancelledError) and attempt.take_abort()
            close_quietly(resp)
            if aborted or isinstance(exc, (UpstreamError, asyncio.TimeoutError)):
                attempt.finish("failure")
                raise RetryableFailure("unhealthy" if aborted else failure_reason(exc)) \
                    from None
            attempt.finish("none")
            raise
        headers = resp.picked_headers(PASSED_HEADERS)
        body = relay(self.metrics, self.config.request_timeout_secs, path, request, attempt, resp,
                     chunks, first, t0)
        return RelayResponse(body, attempt, resp, status_code=resp.status,
                             headers=headers)


def _retry_after(resp: UpstreamResponse) -> float:
    try:
        return float(resp.headers.get("retry-after", 0))
    except ValueError:
        return 0.0
