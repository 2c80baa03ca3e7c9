"""Subscribe to one worker's KV events (ZMQ SUB) and keep its ``BlockIndex`` current.

Wire format: ``heron.engine.kv_events`` (multipart ``[topic, seq, payload]``, ``seq`` an
8-byte big-endian counter, the payload a msgpack batch of events). ZMQ reconnects a SUB socket
by itself when the worker goes away and comes back; what the subscriber must notice is lost
batches: a sequence gap (the PUB dropped at its high-water mark) or a sequence that went back
(the worker restarted, its cache is new). Either way the index is cleared: from then on it
under-reports what the worker holds, it never claims blocks the worker no longer has.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

from heron.route.policies.block_index import BlockIndex

logger = logging.getLogger("heron.route")

RECV_TIMEOUT_S = 1.0  # how often the receive loop wakes to check that it should go on
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


def connect_address(endpoint: str, worker_url: str) -> str:
    """The address to connect to for a worker's bound ``endpoint``: a wildcard host
    (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) becomes the worker URL's host. Other
    endpoints (a concrete host, ``ipc://``) are used as they are."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or host not in WILDCARD_HOSTS:
        return endpoint
    worker_host = urlsplit(worker_url).hostname or "127.0.0.1"
    if ":" in worker_host:  # IPv6 literal
        worker_host = f"[{worker_host}]"
    return f"tcp://{worker_host}:{port}"


class KVEventSubscriber:
    """One worker's event stream applied to ``index``, on a background asyncio task.

    Contract: after ``start``, every batch received is applied in order; a batch whose
    sequence number is not the previous one plus one (after the first) clears the index
    first, then is applied. ``stop`` cancels the task and closes the socket. Counters
    (``batches``, ``gaps``) are for tests and metrics.
    """

    def __init__(self, address: str, index: BlockIndex, name: str = "") -> None:
        self.address = address
        self.index = index
        self.name = name or address
        self.batches = 0
        self.gaps = 0
        self.last_seq: int | None = None
        self._task: asyncio.Task | None = None
        self._sock = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Connect and start receiving (call on the event loop)."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)  # ms; doubling up to the max
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.address)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name=f"kv-events {self.name}")
        logger.info("subscribed to KV events of %s at %s", self.name, self.address)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _run(self) -> None:
        sock = self._sock
        while True:
            if not await sock.poll(RECV_TIMEOUT_S * 1000):
                continue
            try:
                self.handle(await sock.recv_multipart())
            except asyncio.CancelledError:
                raise
            except Exception:  # a malformed batch: drop it, and what it may have held
                logger.exception("bad KV event batch from %s; clearing its index", self.name)
                self.index.clear()
                self.last_seq = None

    def handle(self, frames: list[bytes]) -> None:
        """Apply one multipart message ``[topic, seq, payload]``."""
        from heron.engine.kv_events import decode_batch

        if len(frames) != 3:
            raise ValueError(f"expected 3 frames, got {len(frames)}")
        seq = int.from_bytes(frames[1], "big")
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1
            logger.warning("KV events of %s: sequence %d after %d (%s); clearing its index",
                           self.name, seq, self.last_seq,
                           "worker restarted" if seq <= self.last_seq else "batches lost")
            self.index.clear()
        self.last_seq = seq
        _, events = decode_batch(frames[2])
        for event in events:
            self.index.apply(event)
        self.batches += 1
