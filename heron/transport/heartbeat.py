"""The engine core's heartbeat: a thread that tells the API process the core is alive.

It sends ``Heartbeat`` on a PUSH socket of its own (ZMQ sockets are not thread-safe) to the
same output address the step loop uses, every ``interval`` seconds, whatever the step loop is
doing: torch releases the GIL inside its kernels, so a long prefill does not silence it, while
a frozen (SIGSTOP), hung-with-the-GIL or dead process does. The API side treats a silence of
a few intervals as a dead engine.
"""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

from heron.transport import messages as m

HEARTBEAT_INTERVAL_S = 1.0


class HeartbeatThread(threading.Thread):
    """Daemon thread; ``stop()`` ends it and closes its socket."""

    def __init__(self, ctx: zmq.Context, address: str,
                 interval: float = HEARTBEAT_INTERVAL_S) -> None:
        super().__init__(name="heron-heartbeat", daemon=True)
        self._ctx, self._address, self._interval = ctx, address, interval
        self._stopped = threading.Event()

    def run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(self._address)
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._stopped.wait(self._interval):
                try:
                    sock.send(encoder.encode(m.Heartbeat(time.monotonic())), zmq.NOBLOCK)
                except zmq.ZMQError:
                    return  # the context is going away
        finally:
            sock.close()

    def stop(self) -> None:
        self._stopped.set()
        self.join(2 * self._interval)
