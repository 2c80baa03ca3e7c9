"""Global admission: the router's own in-flight limit with a bounded FIFO queue in front of it,
and the refusals when every worker is saturated.

``--max-concurrent-requests`` requests run at once; up to ``--queue-size`` more wait, each at
most ``--queue-timeout-secs``. A full queue answers 429, a wait that times out 408 (SGLang's
choices). Retry-After is computed from the observed completion rate: with ``ahead`` requests
to finish before a new one would fit and completions at ``r`` per second (an exponentially
weighted rate), ``ceil(ahead / r)`` clamped to [1, 60].

Everything but :meth:`Admission.acquire` is synchronous (atomic on one event loop).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time

MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class Refused(Exception):
    """The router refuses a request: HTTP ``status`` with an OpenAI error body and, for 429
    and 503, a Retry-After header."""

    def __init__(self, status: int, message: str, type_: str, reason: str,
                 retry_after_s: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.message = message
        self.type = type_
        self.reason = reason  # metric label: queue_full, queue_timeout, saturated, ...
        self.retry_after_s = retry_after_s


def clamp_retry_after(seconds: float) -> int:
    return int(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(seconds))))


class CompletionRate:
    """Requests finished per second, exponentially weighted over ``half_life_s``."""

    def __init__(self, half_life_s: float = 10.0) -> None:
        self._tau = half_life_s / math.log(2)
        self._rate = 0.0
        self._last = time.monotonic()

    def record(self) -> None:
        now = time.monotonic()
        decay = math.exp(-(now - self._last) / self._tau)
        self._rate = self._rate * decay + 1.0 / self._tau  # each event adds 1/tau
        self._last = now

    @property
    def per_second(self) -> float:
        return self._rate * math.exp(-(time.monotonic() - self._last) / self._tau)

    def retry_after(self, ahead: int) -> int:
        rate = self.per_second
        return MIN_RETRY_AFTER_S if rate <= 0 else clamp_retry_after(max(1, ahead) / rate)


class Admission:
    """The in-flight limit and its queue. Contract: every successful ``acquire`` is paired
    with one ``release`` (use ``slot()``). Waiters are served first come, first served."""

    def __init__(self, max_concurrent: int | None, queue_size: int,
                 queue_timeout_s: float) -> None:
        self.max_concurrent = max_concurrent or None  # None: unlimited
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self.rate = CompletionRate()
        self.draining = False

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if needed; raises :class:`Refused`."""
        if self.draining:
            raise Refused(503, "the router is shutting down", "service_unavailable",
                          "draining", MIN_RETRY_AFTER_S)
        if self.max_concurrent is None or (self.in_flight < self.max_concurrent
                                           and not self._waiters):
            self.in_flight += 1
            return
        if len(self._waiters) >= self.queue_size:
            ahead = self.in_flight + len(self._waiters) - self.max_concurrent + 1
            raise Refused(429, f"the router's queue is full ({self.queue_size} waiting)",
                          "rate_limit_exceeded", "queue_full", self.rate.retry_after(ahead))
        await self._wait()

    async def _wait(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():
                return  # the slot came in the same tick as the timeout: keep it
            fut.cancel()
            raise Refused(408, f"waited {self.queue_timeout_s:g} s in the router's queue",
                          "timeout", "queue_timeout") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot, then cancelled: pass it on
            else:
                fut.cancel()
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def release(self) -> None:
        """Give the slot back; the first live waiter inherits it (in_flight unchanged)."""
        self.rate.record()
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.in_flight -= 1

    def slot(self) -> "_Slot":
        return _Slot(self)


class _Slot:
    """``async with admission.slot():`` acquire, then release exactly once."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def __aenter__(self) -> None:
        await self.admission.acquire()

    async def __aexit__(self, *exc) -> None:
        self.admission.release()


def saturation_refusal(saturated_until: list[float], breaker_waits: list[float]) -> Refused:
    """429 when every available worker is saturated; Retry-After: the soonest one frees up
    (its 429 cooldown or Retry-After ends)."""
    now = time.monotonic()
    waits = [max(0.0, t - now) for t in saturated_until] + breaker_waits
    return Refused(429, "every worker is saturated; retry later", "rate_limit_exceeded",
                   "saturated", clamp_retry_after(min(waits) if waits else 1))
