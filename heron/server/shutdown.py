"""How `heron serve` stops: drain, cut what is left, stop the engine, and only then close the
listener, so that nobody meets a closed port while the process is still there.

On SIGTERM/SIGINT (or an engine failure) the server drains: ``/ready``, ``/health`` and new
engine requests answer 503 with ``Retry-After`` (``guards``), while the requests that were in
flight get up to ``--shutdown-timeout`` seconds to finish. Those still open then are aborted
in the engine (their KV blocks freed) and end loudly: a stream with an error event and no
``[DONE]``, any other request with a JSON 503. Then the engine core is stopped, and uvicorn
closes the listener and exits (status 0 after a signal, 1 after an engine failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger("heron.server")

POLL_S = 0.05  # how often the drain looks at what is still in flight
CUT_WAIT_S = 10.0  # after the cut: how long aborted requests get to write their 503 / error
# uvicorn's own grace once the listener is closed: only responses already cut remain
UVICORN_GRACE_S = 5


class InFlightRequests:
    """ASGI middleware counting the HTTP requests that arrived before draining began and
    have not finished (their response fully sent). Requests that arrive while draining are
    answered 503 at once by the guard and are not counted."""

    def __init__(self, app: ASGIApp, state) -> None:
        self.app = app
        self.state = state
        self.count = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.state.draining:
            await self.app(scope, receive, send)
            return
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn, with heron's stop sequence (module docstring) run before uvicorn's own
    shutdown closes the listening socket. Exits 0 after a signal (stock uvicorn re-raises it:
    status -15); a second SIGINT cuts the drain short."""

    def __init__(self, config: uvicorn.Config, state, client, in_flight: InFlightRequests,
                 grace_s: float) -> None:
        super().__init__(config)
        self.heron_state = state
        self.client = client
        self.in_flight = in_flight
        self.grace_s = grace_s

    def handle_exit(self, sig, frame) -> None:
        # draining first, synchronously: from here on probes and new requests get 503
        self.heron_state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        self.heron_state.draining = True
        logger.info("shutting down: new requests get 503; in-flight ones get up to %g s "
                    "(--shutdown-timeout)", self.grace_s)
        try:
            await self._drain()
            await self.client.shutdown()  # still answering 503 while the engine stops
        except Exception:  # noqa: BLE001 - the listener must close and the process exit
            logger.exception("draining failed")
        await super().shutdown(sockets)
        logger.info("heron serve stopped")

    async def _drain(self) -> None:
        open_ = self.in_flight.count
        if open_:
            logger.info("draining: %d request(s) in flight get up to %g s to finish; new "
                        "requests get 503", open_, self.grace_s)
        await self._wait_until(lambda: self.in_flight.count == 0 or self.force_exit,
                               self.grace_s)
        if self.in_flight.count == 0:
            return
        if self.force_exit:  # a second Ctrl-C
            reason = "the server was told to stop at once and aborted this request"
        else:
            reason = (f"the server is shutting down and this request did not finish within "
                      f"its {self.grace_s:g} s grace period (--shutdown-timeout)")
        aborted = self.client.abort_all(reason)
        logger.warning("shutdown: aborted %d engine request(s) (%s); %d HTTP request(s) end "
                       "with 503 or an error event", aborted,
                       "stop at once" if self.force_exit else f"{self.grace_s:g} s grace over",
                       self.in_flight.count)
        await self._wait_until(lambda: self.in_flight.count == 0, CUT_WAIT_S)

    @staticmethod
    async def _wait_until(done, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
