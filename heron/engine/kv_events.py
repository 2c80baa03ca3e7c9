"""KV-cache events: what the prefix cache stores and evicts, named by block hashes.

A cache-aware router subscribes to learn which instance holds which prefixes. Block hashes
chain (see ``prefix_cache.block_hashes``), so a router hashes a new prompt's blocks the same way
and asks who holds the longest run of them.

Wire format (``KVEventPublisher``, a ZMQ PUB socket): multipart ``[topic, seq, payload]`` with
``seq`` an 8-byte big-endian counter (gaps mean the subscriber missed batches) and ``payload``
a msgpack map ``{"ts": unix time, "events": [{"type": "BlockStored", ...}, ...]}``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None  # None: the blocks start at the root of their salt
    token_ids: list[int]
    block_size: int


@dataclass
class BlockRemoved:
    block_hashes: list[int]


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_to_dict(event: KVEvent) -> dict:
    return {"type": type(event).__name__, **dataclasses.asdict(event)}


class KVEventPublisher:
    """Publishes batches of events on a ZMQ PUB socket bound to ``endpoint``."""

    def __init__(self, endpoint: str, topic: str = "kv-events") -> None:
        import msgspec
        import zmq

        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)  # a slow subscriber drops, never blocks us
        self._sock.bind(endpoint)
        self._topic = topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        self._seq = 0
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = self._encode({"ts": time.time(), "events": [event_to_dict(e) for e in events]})
        self._seq += 1
        try:
            self._sock.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload],
                                      self._noblock)
        except self._again:
            pass  # PUB drops at the high-water mark anyway; the seq gap tells subscribers

    def close(self) -> None:
        self._sock.close()


def decode_batch(payload: bytes) -> tuple[float, list[dict]]:
    """Subscriber side: (timestamp, event dicts) of one published payload."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    return batch["ts"], batch["events"]
