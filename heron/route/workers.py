"""The workers behind the router: what is known of each one, and the set of them.

A :class:`WorkerState` is owned by the :class:`WorkerRegistry`; the proxy updates its load
counters, the health checker its health, server info and scraped gauges. Policies read it and
never mutate it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

from heron.route.breaker import CircuitBreaker
from heron.route.config import RouterConfig

logger = logging.getLogger("heron.route")


def normalize_url(url: str) -> str:
    """``127.0.0.1:8000`` -> ``http://127.0.0.1:8000``; no trailing slash. Raises ValueError
    for anything that is not an http(s) URL with a host."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a worker URL: {url!r}")
    return url


@dataclass(eq=False)
class WorkerState:
    """One upstream `heron serve` (or any OpenAI server). Load counters are exact for the
    requests this router sent (incremented on dispatch, decremented when the response ends);
    ``waiting_requests`` and the prefix-cache counters are the worker's own, as last scraped."""

    url: str
    breaker: CircuitBreaker
    source: str = "flag"  # "flag" | "file" | "api": the worker file removes only its own
    outstanding_requests: int = 0
    outstanding_tokens: int = 0  # prompt-token estimates of the outstanding requests
    healthy: bool = True  # optimistic until health checks say otherwise
    server_info: dict | None = None  # GET /server_info (None: not served or not fetched)
    waiting_requests: int = 0  # heron:num_requests_waiting
    running_requests: int = 0  # heron:num_requests_running
    prefix_cache_queries: float = 0.0  # heron:prefix_cache_queries_total
    prefix_cache_hits: float = 0.0  # heron:prefix_cache_hits_total
    consecutive_health_failures: int = 0
    consecutive_health_successes: int = 0
    saturated_until: float = 0.0  # monotonic time: it answered 429 recently
    added_at: float = field(default_factory=time.monotonic)
    # the proxy's unfinished attempts on this worker (each has .abort()): when the worker
    # turns unhealthy they are aborted, so nothing waits on a hung worker until its timeout
    in_flight: set = field(default_factory=set, repr=False)

    def abort_in_flight(self) -> int:
        """Abort every unfinished attempt on this worker; how many there were."""
        attempts = list(self.in_flight)
        for attempt in attempts:
            attempt.abort()
        return len(attempts)

    @property
    def available(self) -> bool:
        """Healthy and its breaker lets a request through."""
        return self.healthy and self.breaker.available()

    @property
    def reported_hit_rate(self) -> float | None:
        """The worker's own prefix-cache hit rate since it started (None before any query)."""
        if self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    def saturated(self, config: RouterConfig, now: float | None = None) -> bool:
        """It answered 429 within its cooldown, or its queue is longer than the limit."""
        now = time.monotonic() if now is None else now
        if now < self.saturated_until:
            return True
        limit = config.max_worker_waiting_requests
        return bool(limit) and self.waiting_requests > limit

    def describe(self) -> dict:
        """The JSON of ``GET /workers``."""
        return {"url": self.url, "healthy": self.healthy, "breaker": self.breaker.state,
                "source": self.source, "outstanding_requests": self.outstanding_requests,
                "outstanding_tokens": self.outstanding_tokens,
                "waiting_requests": self.waiting_requests,
                "running_requests": self.running_requests,
                "prefix_cache_hit_rate": self.reported_hit_rate,
                "server_info": self.server_info}


class WorkerRegistry:
    """The set of workers, in the order they were added. Listeners (the policy, metrics,
    the health checker) hear of every addition and removal, after it happened."""

    def __init__(self, config: RouterConfig,
                 on_breaker_transition: Callable[[str, str, str], None] | None = None) -> None:
        self.config = config
        self._workers: dict[str, WorkerState] = {}
        self._on_breaker_transition = on_breaker_transition
        self.added_listeners: list[Callable[[WorkerState], None]] = []
        self.removed_listeners: list[Callable[[WorkerState], None]] = []

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, url: str) -> bool:
        return normalize_url(url) in self._workers

    def get(self, url: str) -> WorkerState | None:
        return self._workers.get(normalize_url(url))

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def available(self) -> list[WorkerState]:
        return [w for w in self._workers.values() if w.available]

    def add(self, url: str, source: str = "flag") -> WorkerState:
        """Add a worker (idempotent: an existing URL is returned as it is)."""
        url = normalize_url(url)
        if url in self._workers:
            return self._workers[url]
        cfg = self.config
        breaker = CircuitBreaker(cfg.cb_failure_threshold, cfg.cb_success_threshold,
                                 cfg.cb_timeout_duration_secs,
                                 enabled=not cfg.disable_circuit_breaker,
                                 on_transition=self._transition_hook(url))
        worker = WorkerState(url=url, breaker=breaker, source=source)
        self._workers[url] = worker
        logger.info("worker added: %s (%s)", url, source)
        for listener in self.added_listeners:
            listener(worker)
        return worker

    def remove(self, url: str) -> WorkerState | None:
        worker = self._workers.pop(normalize_url(url), None)
        if worker is not None:
            logger.info("worker removed: %s", worker.url)
            for listener in self.removed_listeners:
                listener(worker)
        return worker

    def sync_source(self, source: str, urls: list[str]) -> None:
        """Make the workers of ``source`` exactly ``urls`` (the worker file after a change);
        workers from other sources are left alone."""
        wanted = {normalize_url(u) for u in urls}
        for worker in self.all():
            if worker.source == source and worker.url not in wanted:
                self.remove(worker.url)
        for url in urls:
            self.add(url, source)

    def _transition_hook(self, url: str) -> Callable[[str, str], None]:
        def hook(old: str, new: str) -> None:
            logger.warning("circuit breaker of %s: %s -> %s", url, old, new)
            if self._on_breaker_transition is not None:
                self._on_breaker_transition(url, old, new)
        return hook


def read_worker_file(path: str) -> list[str]:
    """Worker URLs from a file: one a line (or whitespace-separated), '#' starts a comment."""
    urls = []
    with open(path) as f:
        for line in f:
            urls.extend(line.split("#", 1)[0].split())
    return [normalize_url(u) for u in urls]
