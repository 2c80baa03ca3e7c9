"""Admission control: refuse work (HTTP 429 + Retry-After) when the server's queue is full.

What counts as *queued*: every request the server has admitted and not yet released, i.e.
admitted and not finished (waiting in the engine or running); limits apply to their number,
their prompt tokens and their sequences (prompts x n: one request can carry many). The server calls
:meth:`AdmissionController.try_admit` before handing a request to the engine and
:meth:`AdmissionController.release` exactly once when it leaves: finished, failed, or aborted
(client disconnect). :meth:`AdmissionController.admitted` pairs the two as a context manager
and :class:`Admission` makes the release idempotent for code paths that may race.

Retry-After comes from the observed drain rate: an exponentially weighted count of releases
(requests and prompt tokens) measured on a *busy clock* that only advances while something
is queued, so idle periods neither decay the history nor dilute the rate. With rate ``r``
and ``excess`` work to drain before the refused request would fit, the hint is
``ceil(excess / r)`` clamped to [1, 60]; 1 when nothing has drained yet.

All methods are synchronous (no awaits), so on one asyncio loop each is atomic.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterator, Optional

MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class Overloaded(Exception):
    """The queue is full; answer 429 with ``Retry-After: retry_after_seconds``."""

    def __init__(self, retry_after_seconds: int, message: str) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds
        self.message = message


class AdmissionController:
    """Bounds admitted-but-unfinished requests and their prompt tokens (``None`` or 0 for a
    limit means unlimited). A request that arrives to an empty queue is always admitted, so a
    prompt longer than ``max_queued_tokens`` cannot be refused forever."""

    def __init__(self, max_queued_requests: Optional[int] = None,
                 max_queued_tokens: Optional[int] = None, *,
                 max_queued_sequences: Optional[int] = None, half_life_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_queued_requests = max_queued_requests or None
        self.max_queued_tokens = max_queued_tokens or None
        self.max_queued_sequences = max_queued_sequences or None
        self.queued_requests = 0
        self.queued_tokens = 0
        self.queued_sequences = 0
        self._tau = half_life_s / math.log(2)
        self._clock = clock
        self._last = clock()
        self._busy_elapsed = 0.0
        self._drained_requests = 0.0  # exponentially decayed counts (busy clock)
        self._drained_tokens = 0.0

    # ------------------------------------------------------------ admission

    def try_admit(self, num_prompt_tokens: int, num_sequences: int = 1) -> None:
        """Count the request as queued, or raise :class:`Overloaded`."""
        self._advance()
        if self.queued_requests > 0:
            excess_req, excess_tok = self._excess(num_prompt_tokens, num_sequences)
            if excess_req > 0 or excess_tok > 0:
                raise Overloaded(self.retry_after(excess_req, excess_tok), self._why(
                    excess_req, excess_tok))
        self.queued_requests += 1
        self.queued_tokens += num_prompt_tokens
        self.queued_sequences += num_sequences

    def release(self, num_prompt_tokens: int, num_sequences: int = 1) -> None:
        """The request left the server (finished, failed or aborted): free its room."""
        self._advance()
        if self.queued_requests <= 0:
            raise RuntimeError("release() without a matching try_admit()")
        self.queued_requests -= 1
        self.queued_tokens = max(0, self.queued_tokens - num_prompt_tokens)
        self.queued_sequences = max(0, self.queued_sequences - num_sequences)
        self._drained_requests += 1.0
        self._drained_tokens += num_prompt_tokens

    def admit(self, num_prompt_tokens: int, num_sequences: int = 1) -> "Admission":
        """:meth:`try_admit`, returning a handle whose ``release()`` is idempotent."""
        self.try_admit(num_prompt_tokens, num_sequences)
        return Admission(self, num_prompt_tokens, num_sequences)

    @contextlib.contextmanager
    def admitted(self, num_prompt_tokens: int, num_sequences: int = 1
                 ) -> Iterator["Admission"]:
        """``with controller.admitted(n): ...`` admits, and always releases on exit."""
        handle = self.admit(num_prompt_tokens, num_sequences)
        try:
            yield handle
        finally:
            handle.release()

    def _excess(self, num_prompt_tokens: int, num_sequences: int = 1) -> tuple[int, int]:
        """(requests, tokens) that must drain before this request fits; sequences over their
        limit count as requests (each request holds at least one)."""
        req = tok = 0
        if self.max_queued_requests is not None:
            req = self.queued_requests + 1 - self.max_queued_requests
        if self.max_queued_sequences is not None:
            req = max(req, self.queued_sequences + num_sequences - self.max_queued_sequences)
        if self.max_queued_tokens is not None:
            tok = self.queued_tokens + num_prompt_tokens - self.max_queued_tokens
        return max(0, req), max(0, tok)

    def _why(self, excess_req: int, excess_tok: int = 0) -> str:
        if self.max_queued_requests is not None and \
                self.queued_requests >= self.max_queued_requests:
            return (f"server overloaded: {self.queued_requests} requests queued "
                    f"(limit {self.max_queued_requests})")
        if excess_req > 0:
            return (f"server overloaded: {self.queued_sequences} sequences queued "
                    f"(limit {self.max_queued_sequences})")
        return (f"server overloaded: {self.queued_tokens} prompt tokens queued "
                f"(limit {self.max_queued_tokens})")

    # ------------------------------------------------------------ drain rate

    def _advance(self) -> None:
        """Move the busy clock: decay history only for time spent with work queued."""
        now = self._clock()
        dt = max(0.0, now - self._last)
        self._last = now
        if self.queued_requests > 0 and dt > 0:
            decay = math.exp(-dt / self._tau)
            self._drained_requests *= decay
            self._drained_tokens *= decay
            self._busy_elapsed += dt

    def drain_rate(self) -> tuple[Optional[float], Optional[float]]:
        """(requests/s, prompt tokens/s) drained while busy; None without history.

        A decayed count of events at a steady rate r over busy time E is
        r * tau * (1 - exp(-E / tau)), so dividing by that window is unbiased from the start.
        """
        self._advance()
        window = self._tau * (1.0 - math.exp(-self._busy_elapsed / self._tau))
        if window <= 0 or self._drained_requests <= 0:
            return None, None
        tokens = self._drained_tokens / window if self._drained_tokens > 0 else None
        return self._drained_requests / window, tokens

    def retry_after(self, excess_requests: int, excess_tokens: int = 0) -> int:
        """Seconds until ``excess`` work should have drained, clamped to [1, 60]."""
        req_rate, tok_rate = self.drain_rate()
        if req_rate is None:
            return MIN_RETRY_AFTER_S
        waits = [excess_requests / req_rate]
        if excess_tokens > 0:
            waits.append(excess_tokens / tok_rate if tok_rate else math.inf)
        wait = max(waits)
        if math.isinf(wait):
            return MAX_RETRY_AFTER_S
        return int(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(wait))))


class Admission:
    """An admitted request's handle; ``release()`` only counts once."""

    def __init__(self, controller: AdmissionController, num_prompt_tokens: int,
                 num_sequences: int = 1) -> None:
        self._controller = controller
        self.num_prompt_tokens = num_prompt_tokens
        self.num_sequences = num_sequences
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._controller.release(self.num_prompt_tokens, self.num_sequences)
