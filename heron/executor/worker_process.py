"""Main of a worker rank: ``python -m heron.executor.worker_process CORE_ADDR RANK INIT_METHOD
PARENT_PID``.

Connects to the core (a ZMQ DEALER named by its rank), says hello, receives the engine
config, loads its shard (joining the torch.distributed world at ``INIT_METHOD``), answers
``WorkerInfo``, then runs each step it receives until its socket closes, it is terminated, or
its parent process is gone (``PARENT_PID`` 0: a rank on another node, no parent to watch). A
thread sends heartbeats on a second connection, so the core notices a rank that froze.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import msgspec
import zmq

from heron.config import EngineConfig
from heron.logging_config import configure as configure_logging
from heron.executor.wire import (CoreMsg, Hello, Shutdown, StepDone, StepFailed,
                                 WorkerStartupFailed)
from heron.worker.rank_stats import RankStats

logger = logging.getLogger("heron.worker")

PARENT_CHECK_MS = 1000
HEARTBEAT_S = 0.5


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def heartbeat_identity(rank: int) -> bytes:
    return f"hb{rank}".encode()


def _heartbeats(ctx: zmq.Context, address: str, rank: int) -> None:
    """A daemon thread's loop: an empty frame every HEARTBEAT_S until the process exits."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, heartbeat_identity(rank))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    while True:
        time.sleep(HEARTBEAT_S)
        sock.send(b"")


def _dealer(ctx: zmq.Context, address: str, rank: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(rank).encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    return sock


def _load(sock, encoder, rank: int, init_method: str):
    """The worker for the config the core sends, or None after reporting a failure."""
    config = msgspec.msgpack.decode(sock.recv(), type=EngineConfig)
    try:
        from heron.worker.worker import Worker

        return Worker(config, rank, init_method)
    except Exception as exc:  # noqa: BLE001 - reported to the core, which fails to start
        logger.debug("worker startup failed", exc_info=True)  # the core reports it in a line
        sock.send(encoder.encode(WorkerStartupFailed(_describe(exc))))
        return None


def _parent_gone(parent_pid: int) -> bool:
    return parent_pid != 0 and os.getppid() != parent_pid


class _StepLoop:
    """Runs the core's steps on a loaded worker: each answered with a StepDone (this rank's
    totals after it, and the outcome on the driver) or a StepFailed."""

    def __init__(self, worker, rank: int) -> None:
        self.worker, self.rank = worker, rank
        self.steps, self.busy_s = 0, 0.0

    def handle(self, msg):
        started = time.perf_counter()
        try:
            output = self.worker.execute_model(msg)
        except Exception as exc:  # noqa: BLE001 - the core isolates the requests to blame
            logger.exception("step failed in worker rank %d", self.rank)
            output = StepFailed(_describe(exc), msg.step_id)
        self.busy_s += time.perf_counter() - started
        self.steps += 1
        if isinstance(output, StepFailed):
            return output
        return StepDone(msg.step_id, self._stats(), output)

    def _stats(self) -> RankStats:
        from heron.attention.context_parallel import CP_STATS
        from heron.distributed.parallel_state import COMM

        return RankStats(self.rank, self.steps, self.busy_s, COMM.collective_s,
                         COMM.collective_bytes, COMM.collective_calls, COMM.p2p_s,
                         COMM.p2p_bytes, CP_STATS.kv_tokens_stored,
                         CP_STATS.split_prefill_tokens)


def serve(address: str, rank: int, init_method: str, parent_pid: int) -> None:
    ctx = zmq.Context()
    threading.Thread(target=_heartbeats, args=(ctx, address, rank), daemon=True).start()
    sock = _dealer(ctx, address, rank)
    encoder = msgspec.msgpack.Encoder()
    sock.send(encoder.encode(Hello(rank)))
    worker = _load(sock, encoder, rank, init_method)
    if worker is None:
        return
    sock.send(encoder.encode(worker.info()))
    decoder = msgspec.msgpack.Decoder(CoreMsg)
    loop = _StepLoop(worker, rank)
    while True:
        if not sock.poll(PARENT_CHECK_MS):
            if _parent_gone(parent_pid):
                return
            continue
        msg = decoder.decode(sock.recv())
        if isinstance(msg, Shutdown):
            return
        sock.send(encoder.encode(loop.handle(msg)))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the core's to handle
    address, rank, init_method, parent_pid = sys.argv[1:5]
    configure_logging(process=f"rank{rank}")  # the core's level, through the environment
    serve(address, int(rank), init_method, int(parent_pid))


if __name__ == "__main__":
    main()
