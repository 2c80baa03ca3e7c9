"""Active health checks: every interval, each worker's ``GET /health`` (with a timeout, so a
hung worker, e.g. SIGSTOPped, fails it), a scrape of its ``/metrics`` (queue length, prefix
cache counters) and its ``/server_info`` (replaced only when its content changed; None while
the worker is unhealthy, so a restarted worker's info is a new object). The same loop re-reads
the worker file when it changed.

A worker turns unhealthy after ``health_failure_threshold`` consecutive failed checks and
healthy again after ``health_success_threshold`` consecutive good ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re

from heron.route.config import RouterConfig
from heron.route.upstream import Upstream, UpstreamError
from heron.route.workers import WorkerRegistry, WorkerState, read_worker_file

logger = logging.getLogger("heron.route")

# heron's metric names (heron/server/engine_metrics.py): gauges bare, counters with _total
_SCRAPED = {"heron:num_requests_waiting": "waiting_requests",
            "heron:num_requests_running": "running_requests",
            "heron:prefix_cache_queries_total": "prefix_cache_queries",
            "heron:prefix_cache_hits_total": "prefix_cache_hits"}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """The scraped series' values, summed over label sets (one engine: one series each)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("heron:"):
            continue
        m = _SAMPLE.match(line)
        if m and m.group(1) in _SCRAPED:
            try:
                values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                continue
    return values


class HealthChecker:
    """Runs the check loop as one background task. ``check_worker`` may also be called on its
    own (the app checks each new worker once before its policy hears of it)."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry,
                 upstream: Upstream, headers: dict[str, str]) -> None:
        self.config = config
        self.registry = registry
        self.upstream = upstream
        self.headers = headers
        self._task: asyncio.Task | None = None
        self._file_mtime: float | None = None

    def start(self) -> None:
        self.reload_worker_file()
        self._task = asyncio.create_task(self._loop(), name="heron-route-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            self.reload_worker_file()
            workers = self.registry.all()
            if workers:
                await asyncio.gather(*(self.check_worker(w) for w in workers),
                                     return_exceptions=True)
            await asyncio.sleep(self.config.health_check_interval_secs)

    async def check_worker(self, worker: WorkerState) -> None:
        """One round for one worker: /health decides; /metrics and /server_info inform."""
        ok = await self._get_ok(worker, "/health")
        self.record(worker, ok)
        if not ok:
            return
        await self._scrape_metrics(worker)
        await self._fetch_server_info(worker)

    def record(self, worker: WorkerState, ok: bool) -> None:
        """Apply one check's outcome to the worker's consecutive counts and health."""
        cfg = self.config
        if ok:
            worker.consecutive_health_failures = 0
            worker.consecutive_health_successes += 1
            if not worker.healthy and \
                    worker.consecutive_health_successes >= cfg.health_success_threshold:
                worker.healthy = True
                logger.warning("worker %s is healthy again", worker.url)
        else:
            worker.consecutive_health_successes = 0
            worker.consecutive_health_failures += 1
            if worker.healthy and \
                    worker.consecutive_health_failures >= cfg.health_failure_threshold:
                worker.healthy = False
                worker.server_info = None  # fetched afresh when it returns (maybe restarted)
                aborted = worker.abort_in_flight()
                logger.warning("worker %s failed %d health checks: unhealthy (%d requests "
                               "in flight aborted)", worker.url,
                               worker.consecutive_health_failures, aborted)

    async def _get(self, worker: WorkerState, path: str) -> tuple[int, bytes]:
        """(status, body) of a GET within the health-check timeout; (0, b"") on failure."""
        try:
            return await self.upstream.get(worker.url + path, self.headers,
                                           self.config.health_check_timeout_secs)
        except UpstreamError:
            return 0, b""

    async def _get_ok(self, worker: WorkerState, path: str) -> bool:
        status, _ = await self._get(worker, path)
        return status == 200

    async def _scrape_metrics(self, worker: WorkerState) -> None:
        status, body = await self._get(worker, "/metrics")
        if status != 200:
            return
        for name, value in parse_metrics(body.decode("utf-8", "replace")).items():
            setattr(worker, _SCRAPED[name], int(value) if "num_" in name else value)

    async def _fetch_server_info(self, worker: WorkerState) -> None:
        """Replace ``server_info`` only when its content changed: policies may key on the
        object's identity to notice a reconfigured worker. 404: the worker has none."""
        status, body = await self._get(worker, "/server_info")
        if status not in (200, 404):
            return
        info = None
        if status == 200:
            try:
                info = json.loads(body)
            except ValueError:
                return
        info = info if isinstance(info, dict) else None
        if info != worker.server_info:
            worker.server_info = info

    def reload_worker_file(self) -> None:
        """Re-read ``--worker-file`` when its modification time changed; a file that cannot be
        read leaves the workers as they are."""
        path = self.config.worker_file
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime
            if mtime == self._file_mtime:
                return
            urls = read_worker_file(path)
        except (OSError, ValueError) as exc:
            logger.warning("worker file %s: %s (workers unchanged)", path, exc)
            return
        self._file_mtime = mtime
        self.registry.sync_source("file", urls)
