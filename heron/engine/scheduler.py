"""Token-budget continuous batching with chunked prefill and preemption by recompute.

Every step has a budget of ``max_num_batched_tokens``. Running requests are served first
(a decode needs 1 token, an unfinished prefill the rest of its prompt, chunked to the budget),
then waiting requests are admitted in policy order (FCFS, or longest cached prefix first with
a fairness cap) while budget, sequence slots and KV blocks last. Prefill, chunked prefill,
prefix-cache hits and decode are the same rule: ``num_computed_tokens`` catches up with
``num_tokens`` (a hit starts it at the cached length). When the pool runs dry the youngest
running request is preempted (its blocks released, its progress reset) and goes back to the
front of the waiting queue.

A request whose own bookkeeping raises (a lookup, an allocation, caching its blocks) is
finished with status ``FINISHED_ERROR`` and reported in ``SchedulerOutput.failed``; the step
goes on for everyone else.

A waiting request whose next uncached block is being computed right now by a running prefill
(``n > 1`` siblings, users sharing a system prompt) is deferred a step, so it reuses that
block instead of computing it again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from heron.config import SchedulerConfig
from heron.engine.kv_cache import KVCacheManager
from heron.engine.prefix_cache import CacheNode
from heron.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

LPM_WINDOW = 128  # longest-prefix-match ranks at most this many waiting requests per step


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so it samples."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)  # now FINISHED_ERROR

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens scheduled for computation


class Scheduler:
    """Decides which requests run each step and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    # ---- queue management -------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove ``request`` from whichever queue holds it and free its blocks."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.finish_time = time.monotonic()
        self.kv_cache.free(request)

    def fail(self, request: Request, exc: Exception, out: SchedulerOutput | None = None) -> None:
        """Finish ``request`` with FINISHED_ERROR after its processing raised ``exc``."""
        logger.error("request %s failed: %r", request.request_id, exc,
                     exc_info=(type(exc), exc, exc.__traceback__))
        if request.is_finished:
            return
        try:
            self.finish(request, RequestStatus.FINISHED_ERROR)
        except Exception:  # noqa: BLE001 - its blocks may be what is broken
            logger.exception("freeing failed request %s", request.request_id)
            request.status = RequestStatus.FINISHED_ERROR
        if out is not None:
            out.failed.append((request, exc))

    # ---- the step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self.stats.num_steps += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_tokens <= 0:
                i += 1
                continue
            try:
                self._allocate_running(request, num_tokens, out)
            except Exception as exc:  # noqa: BLE001 - this request's bookkeeping broke
                self.fail(request, exc, out)
                continue  # it left self.running: index i is the next request now
            if request.status != RequestStatus.RUNNING:
                break  # preempted itself: nothing younger is left to serve
            out.scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
            i += 1
        return budget

    def _allocate_running(self, request: Request, num_tokens: int, out: SchedulerOutput) -> None:
        """Blocks for ``num_tokens`` more tokens, preempting the youngest until they fit."""
        while self.kv_cache.allocate(request, num_tokens) is None:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self._has_room(budget):
            return  # before any lookup: a full step costs no prefix-cache walk
        in_flight = self._blocks_in_flight()
        for request in self._waiting_in_order():
            try:
                num_tokens = self._try_admit(request, budget, in_flight)
            except Exception as exc:  # noqa: BLE001 - this request's bookkeeping broke
                self.fail(request, exc, out)
                continue
            if num_tokens is None:
                break  # the head waits for blocks, nobody overtakes it
            if num_tokens == 0:
                continue  # deferred: a running prefill is computing its next block
            out.scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
            if not self._has_room(budget):
                break
            in_flight.add(self.kv_cache.uncached_block_hash(request))

    def _try_admit(self, request: Request, budget: int, in_flight: set) -> int | None:
        """Admit ``request`` with its prefix hit: the tokens it computes this step, 0 if it
        is deferred, None if the pool (or the watermark) cannot take it now."""
        hit = self.kv_cache.lookup(request)
        next_block = self.kv_cache.uncached_block_hash(request, hit)
        if next_block is not None and next_block in in_flight:
            return 0
        num_cached = len(hit) * self.kv_cache.block_size
        num_tokens = min(request.num_tokens - num_cached, budget)
        if self._below_watermark(request, num_tokens, hit) or \
                self.kv_cache.allocate(request, num_tokens, hit) is None:
            return None
        self._admit(request, num_cached)
        return num_tokens

    def _has_room(self, budget: int) -> bool:
        """Budget and a sequence slot are left for one more admission."""
        return budget > 0 and len(self.running) < self.config.max_num_seqs

    def _waiting_in_order(self) -> Iterator[Request]:
        """Waiting requests in admission order (each is looked up again when admitted:
        admitting the previous candidate may have evicted blocks)."""
        if self.config.policy == "fcfs" or self.kv_cache.prefix_cache is None:
            yield from list(self.waiting)
            return
        window = list(itertools.islice(self.waiting, LPM_WINDOW))
        hits = [self._hit_length(r) for r in window]

        def rank(i: int) -> tuple[int, int, int]:
            if window[i].num_overtakes >= self.config.max_overtakes:
                return (0, 0, i)  # overtaken too often: goes first, in arrival order
            return (1, -hits[i], i)  # then longest cached prefix first

        for i in sorted(range(len(window)), key=rank):
            yield window[i]

    def _hit_length(self, request: Request) -> int:
        """Cached blocks of ``request``'s prefix, for ranking (0 if the lookup fails: its
        admission attempt then reports the failure)."""
        try:
            return len(self.kv_cache.lookup(request))
        except Exception:  # noqa: BLE001
            return 0

    def _admit(self, request: Request, num_cached: int) -> None:
        for older in self.waiting:
            if older is request:
                break
            older.num_overtakes += 1
        self.waiting.remove(request)
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
        self.kv_cache.record_lookup(request.num_tokens, num_cached)
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _blocks_in_flight(self) -> set[int | None]:
        """Hashes of the blocks that running prefills will cache next."""
        return {self.kv_cache.uncached_block_hash(r) for r in self.running
                if r.num_computed_tokens < r.num_tokens - 1}

    def _below_watermark(self, request: Request, num_tokens: int, hit: list[CacheNode]) -> bool:
        """Admitting ``request`` would leave fewer free blocks than the watermark, while
        others are running (an idle engine always admits, so nothing waits forever)."""
        if not self.running:
            return False
        watermark = int(self.config.kv_watermark * self.kv_cache.num_blocks)
        needed = self.kv_cache.blocks_to_admit(request, num_tokens, hit)
        return self.kv_cache.num_free_blocks - needed < watermark

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1
        out.preempted.append(request)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance progress of every scheduled request by the tokens it computed, and offer
        its newly full blocks to the prefix cache."""
        for s in out.scheduled:
            request = s.request
            if request.num_output_tokens == 0 or \
                    request.num_computed_tokens < request.num_tokens - 1:
                self.stats.num_prefill_tokens += s.num_tokens  # prompt, or recompute
            request.num_computed_tokens += s.num_tokens
            try:
                self.kv_cache.cache_full_blocks(request)
            except Exception as exc:  # noqa: BLE001 - this request's bookkeeping broke
                self.fail(request, exc, out)
