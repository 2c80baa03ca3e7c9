"""A circuit breaker per worker: closed -> open -> half-open (one probe at a time) -> closed.

Closed: requests flow; ``failure_threshold`` consecutive failures open it. Open: no request
goes to the worker until ``timeout_s`` has passed, then it is half-open. Half-open: one probe
request at a time; ``success_threshold`` consecutive successful probes close it, any failure
opens it again (and restarts the timeout).

All methods are synchronous: on one asyncio loop each call is atomic, so ``available`` and
``acquire`` called without an ``await`` between them cannot race.
"""

from __future__ import annotations

import time
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUES = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}  # the gauge's encoding


class CircuitBreaker:
    """Tracks one worker's recent outcomes. Contract: every ``acquire`` that returned True is
    followed by exactly one ``record_success`` or ``record_failure`` (or ``release`` when the
    request ended without a verdict, e.g. the client left)."""

    def __init__(self, failure_threshold: int = 10, success_threshold: int = 3,
                 timeout_s: float = 60.0, enabled: bool = True,
                 on_transition: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.on_transition = on_transition
        self._clock = clock
        self._state = CLOSED
        self._failures = 0  # consecutive, while closed
        self._successes = 0  # consecutive probe successes, while half-open
        self._opened_at = 0.0
        self._probe_in_flight = False  # half-open admits one request at a time

    @property
    def state(self) -> str:
        """The state now (an open breaker whose timeout passed reads half-open)."""
        if self._state == OPEN and self._clock() - self._opened_at >= self.timeout_s:
            self._move(HALF_OPEN)
        return self._state

    def available(self) -> bool:
        """Whether a request may go to the worker now (no side effect)."""
        if not self.enabled:
            return True
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._probe_in_flight)

    def acquire(self) -> bool:
        """Take the right to send one request; in half-open this reserves the probe slot."""
        if not self.available():
            return False
        if self.enabled and self._state == HALF_OPEN:
            self._probe_in_flight = True
        return True

    def release(self) -> None:
        """The request ended without telling whether the worker is well (client left)."""
        self._probe_in_flight = False

    def record_success(self) -> None:
        self._probe_in_flight = False
        if self._state == HALF_OPEN:
            self._successes += 1
            if self._successes >= self.success_threshold:
                self._move(CLOSED)
        self._failures = 0

    def record_failure(self) -> None:
        self._probe_in_flight = False
        if not self.enabled:
            return
        if self._state == HALF_OPEN:
            self._move(OPEN)
            return
        self._failures += 1
        if self._state == CLOSED and self._failures >= self.failure_threshold:
            self._move(OPEN)

    def retry_after_s(self) -> float:
        """Seconds until an open breaker turns half-open (0 when it is not open)."""
        if self.state != OPEN:
            return 0.0
        return max(0.0, self.timeout_s - (self._clock() - self._opened_at))

    def _move(self, new: str) -> None:
        old, self._state = self._state, new
        self._failures = self._successes = 0
        self._probe_in_flight = False
        if new == OPEN:
            self._opened_at = self._clock()
        if self.on_transition is not None and old != new:
            self.on_transition(old, new)
