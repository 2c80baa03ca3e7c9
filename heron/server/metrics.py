"""Prometheus metrics for the server, named like vLLM's under a ``heron:`` prefix.

Two sources: the requests this server saw end (latencies, lengths, finish reasons,
rejections, cost) are observed here; the engine's are derived from its ``EngineStats`` by
the table in ``heron.server.engine_metrics`` (``update_engine_stats`` before each render).
Everything lives on a dedicated CollectorRegistry so several servers (or tests) in one
process never collide. Timestamps passed in are ``time.monotonic()`` values (the engine's
clock); only differences between them are used.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from heron.engine.stats import LATENCY_BUCKETS, TOKEN_BUCKETS, EngineStats
from heron.server.engine_metrics import EngineMetrics
from heron.speculative.stats import SpecDecodingStats


class ServerMetrics:
    """The server's metrics; ``render()`` produces the /metrics response."""

    def __init__(self, cost_per_gpu_hour: Optional[float] = None,
                 throughput_window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.cost_per_gpu_hour = cost_per_gpu_hour
        self.window_s = throughput_window_s
        self._clock = clock
        self._start = clock()
        self._recent: collections.deque[tuple[float, int, int]] = collections.deque()
        self.engine = EngineMetrics()
        self.registry.register(self.engine)
        self._build()

    def _histogram(self, name: str, doc: str, buckets: Iterable[float] = LATENCY_BUCKETS):
        return Histogram(f"heron:{name}", doc, buckets=tuple(buckets), registry=self.registry)

    def _build(self) -> None:
        reg = self.registry
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = self._histogram("inter_token_latency_seconds",
                                   "Time between consecutive output tokens.")
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "Mean time per output token after the first, per request.")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.prefill = self._histogram("request_prefill_time_seconds",
                                       "First scheduled to first token.")
        self.decode = self._histogram("request_decode_time_seconds", "First token to finish.")
        self.prompt_len = self._histogram("request_prompt_tokens", "Prompt tokens per request.",
                                          TOKEN_BUCKETS)
        self.gen_len = self._histogram("request_generation_tokens",
                                       "Generated tokens per request.", TOKEN_BUCKETS)
        self.success = Counter("heron:request_success", "Finished requests.",
                               ["finished_reason"], registry=reg)
        self.rejected = Counter("heron:request_rejected", "Requests refused before running.",
                                ["cause"], registry=reg)
        self.weight_bytes = Gauge("heron:model_weight_bytes",
                                  "Bytes of the model weights as the forward reads them (all "
                                  "ranks), by how they are stored.", ["quantization"],
                                  registry=reg)
        self.cost = None
        if self.cost_per_gpu_hour is not None:
            self.cost = Gauge("heron:cost_per_million_tokens_dollars",
                              "GPU cost per million tokens at the recent throughput "
                              "(kind=generation: output tokens; total: prompt + output).",
                              ["kind"], registry=reg)

    # ------------------------------------------------------------ requests

    def observe_request_finished(self, prompt_tokens: int, completion_tokens: int,
                                 arrival: float, first_token: Optional[float], finish: float,
                                 queue_time: Optional[float] = None,
                                 finish_reason: Optional[str] = "stop",
                                 token_times: Optional[list[float]] = None) -> None:
        """Record one ended request, whatever ended it (``finish_reason`` "abort" when its
        client left or the server cut it, "error" when it failed).

        ``token_times`` are the times each output token (or streamed delta) arrived; their
        differences feed the inter-token-latency histogram. ``queue_time`` is the time from
        arrival until first scheduled (the engine observes it in its own histogram); prefill
        time is what remains before the first token.
        """
        self.e2e.observe(max(0.0, finish - arrival))
        if first_token is not None:
            self.ttft.observe(max(0.0, first_token - arrival))
            self.decode.observe(max(0.0, finish - first_token))
            if completion_tokens > 1:
                self.tpot.observe(max(0.0, finish - first_token) / (completion_tokens - 1))
            if queue_time is not None:
                self.prefill.observe(max(0.0, first_token - arrival - queue_time))
        for prev, cur in zip(token_times or [], (token_times or [])[1:]):
            self.itl.observe(max(0.0, cur - prev))
        self.prompt_len.observe(prompt_tokens)
        self.gen_len.observe(completion_tokens)
        self.success.labels(finished_reason=str(finish_reason or "unknown")).inc()
        self.record_tokens(completion_tokens, prompt_tokens)

    def record_rejection(self, cause: object) -> None:
        """Count a refused request; ``cause`` is the HTTP status ("429", "400", ...)."""
        self.rejected.labels(cause=str(cause)).inc()

    # ------------------------------------------------------------ engine

    def update_engine_stats(self, stats: EngineStats) -> None:
        """Take the engine's latest stats (rendered by the next ``render``); a total that
        goes down (the engine restarted) counts on from where it was."""
        self.engine.update(stats)

    # ------------------------------------------------------------ cost

    def record_tokens(self, generation_tokens: int, prompt_tokens: int = 0,
                      now: Optional[float] = None) -> None:
        """Add tokens to the throughput window behind the cost gauge."""
        now = self._clock() if now is None else now
        self._recent.append((now, generation_tokens, generation_tokens + prompt_tokens))
        self._update_cost(now)

    def throughput(self, now: Optional[float] = None) -> tuple[float, float]:
        """(generation, total) tokens per second over the recent window (or uptime if
        shorter)."""
        now = self._clock() if now is None else now
        while self._recent and self._recent[0][0] <= now - self.window_s:
            self._recent.popleft()
        # At least 1 s, so a burst in the first milliseconds of uptime is not a huge rate.
        span = min(self.window_s, max(1.0, now - self._start))
        gen = sum(r[1] for r in self._recent)
        total = sum(r[2] for r in self._recent)
        return gen / span, total / span

    def _update_cost(self, now: Optional[float] = None) -> None:
        if self.cost is None:
            return
        for kind, rate in zip(("generation", "total"), self.throughput(now)):
            self.cost.labels(kind=kind).set(cost_per_million_tokens(self.cost_per_gpu_hour,
                                                                    rate))

    # ------------------------------------------------------------ exposition

    def render(self, accept: Optional[str] = None) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics; refreshes the cost gauge first. Pass the
        request's Accept header to negotiate OpenMetrics or a text format version."""
        self._update_cost()
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


def spec_decode_summary(now: EngineStats, last: EngineStats | None = None) -> dict | None:
    """Acceptance between two stats snapshots (since the start without ``last``); None when
    no draft was verified in between."""
    if now.spec_decode is None:
        return None
    before = last.spec_decode if last is not None else None
    between = now.spec_decode.since(before or SpecDecodingStats())
    if not between.num_drafts or not between.num_draft_tokens:
        return None
    return between.summary()


def cost_per_million_tokens(cost_per_gpu_hour: float, tokens_per_second: float) -> float:
    """Dollars per million tokens: cost per hour / (tokens per hour / 1e6); NaN when idle."""
    tokens_per_hour = tokens_per_second * 3600.0
    if tokens_per_hour <= 0:
        return math.nan
    return cost_per_gpu_hour / (tokens_per_hour / 1e6)
