"""Token-budget continuous batching with chunked prefill and preemption by recompute.

Every step has a budget of ``max_num_batched_tokens``. Running requests are served first
(a decode needs 1 token, an unfinished prefill the rest of its prompt, chunked to the budget),
then waiting requests are admitted in FCFS order while budget, sequence slots and KV blocks
last. Prefill, chunked prefill and decode are the same rule: ``num_computed_tokens`` catches
up with ``num_tokens``. When the pool runs dry the youngest running request is preempted
(its blocks freed, its progress reset) and goes back to the front of the waiting queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from heron.config import SchedulerConfig
from heron.engine.kv_cache import KVCacheManager
from heron.engine.request import Request, RequestStatus


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
            while self.kv_cache.allocate(request, num_tokens) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # preempted itself: nothing younger is left to serve
            out.scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._below_watermark(request, num_tokens) or \
                    self.kv_cache.allocate(request, num_tokens) is None:
                break  # FCFS: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens

    def _below_watermark(self, request: Request, num_tokens: int) -> bool:
        """Admitting ``request`` would leave fewer free blocks than the watermark, while
        others are running (an idle engine always admits, so nothing waits forever)."""
        if not self.running:
            return False
        watermark = int(self.config.kv_watermark * self.kv_cache.num_blocks)
        needed = self.kv_cache.num_new_blocks(request, num_tokens)
        return self.kv_cache.pool.num_free_blocks - needed < watermark

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
        """Advance progress of every scheduled request by the tokens it computed."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_tokens
