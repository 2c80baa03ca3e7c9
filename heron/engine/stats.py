"""The engine's stats: one typed struct from the core to ``/metrics`` and ``/stats``.

``EngineCore.stats()`` returns an ``EngineStats`` snapshot (nothing in it changes later). The
core process encodes it (``live_stats()``: no copy) into every ``OutputsMsg``; the API process
decodes it typed, serves it as JSON on ``/stats`` and derives the Prometheus metrics from it
(``heron.server.engine_metrics.ENGINE_METRICS``: one row per metric). Its parts are kept where
their values are known and copied in: ``SchedulerStats`` by the scheduler,
``PrefixCacheStats`` by the prefix cache, ``SpecDecodingStats`` by the scheduler as it applies
verified drafts, ``RankStats`` by each worker rank (multiprocess executor only), the step-time
histogram and the request totals by the core.

To add a metric: a field here (kept by whoever knows the value), one row in the table.

Loads without torch: the API process imports it.
"""

from __future__ import annotations

import bisect
from typing import Iterable

import msgspec

from heron.engine.prefix_cache import PrefixCacheStats
from heron.speculative.stats import SpecDecodingStats
from heron.worker.rank_stats import RankStats

# Bucket upper bounds (Prometheus ``le``). 1 ms .. 160 s: a fast decode step up to a long
# queued generation (the server's request-latency histograms use them too).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0, 120.0, 160.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
# 0.5 ms .. 10 s: one engine step, from a small decode batch to a long prefill on a CPU
STEP_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04,
                     0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# vLLM's buckets for ``iteration_tokens_total``
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Histogram(msgspec.Struct):
    """Observations counted in buckets since the engine started: ``counts[i]`` fell in
    (``bounds[i - 1]``, ``bounds[i]``], the last count is those above every bound."""

    bounds: list[float]
    counts: list[int] = []
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    @classmethod
    def of(cls, bounds: Iterable[float]) -> Histogram:
        return cls([float(b) for b in bounds])

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Observations at or below each bound, then all of them (Prometheus buckets)."""
        out, total = [], 0
        for n in self.counts:
            total += n
            out.append(total)
        return out


def _histogram(bounds: Iterable[float]):
    return msgspec.field(default_factory=lambda: Histogram.of(bounds))


class SchedulerStats(msgspec.Struct):
    """Kept by the scheduler; totals since the engine started."""

    num_preemptions: int = 0
    num_steps: int = 0  # schedule() calls
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens scheduled for computation
    # seconds from a sequence's arrival to its first schedule (once per sequence)
    queue_time: Histogram = _histogram(LATENCY_BUCKETS)
    # tokens of each step that computes any (prefill chunks, decodes and drafts together)
    step_tokens: Histogram = _histogram(ITERATION_TOKEN_BUCKETS)


class EngineStats(msgspec.Struct):
    """The engine now (queues, KV cache) and its totals since it started."""

    timestamp: float = 0.0  # time.monotonic() when taken
    num_running: int = 0
    num_waiting: int = 0
    num_unfinished_requests: int = 0  # user-facing requests (n > 1 counts once)
    kv_cache_usage: float = 0.0  # 1 = full
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_cached_blocks: int = 0  # blocks the prefix cache holds (referenced or not)
    num_prompt_tokens_total: int = 0  # prompt tokens of accepted requests
    num_generation_tokens_total: int = 0  # tokens generated (all completions, aborted too)
    num_requests_finished_total: int = 0
    num_requests_rejected_total: int = 0
    scheduler: SchedulerStats = msgspec.field(default_factory=SchedulerStats)
    prefix_cache: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    prefix_cache_enabled: bool = False
    spec_decode: SpecDecodingStats | None = None  # None: no speculative decoding
    step_time: Histogram = _histogram(STEP_TIME_BUCKETS)  # seconds per engine step
    ranks: list[RankStats] = []  # by rank; empty with the in-process executor

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries since the engine started (0 before any query)."""
        queries = self.prefix_cache.queries
        return self.prefix_cache.hits / queries if queries else 0.0


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EngineStats)


def snapshot(stats: EngineStats) -> EngineStats:
    """A deep copy: the live parts it was built from go on changing, the copy does not."""
    return _DECODER.decode(_ENCODER.encode(stats))
