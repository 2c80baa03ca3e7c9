"""Main of a worker process: ``python -m heron.executor.worker_process ADDRESS PARENT_PID``.

Receives the engine config, loads the worker, answers ``WorkerInfo``, then runs each step it
receives until its socket closes, it is terminated, or its parent process is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import zmq

from heron.config import EngineConfig
from heron.executor.wire import CoreMsg, StepFailed, WorkerStartupFailed

logger = logging.getLogger("heron.worker")

PARENT_CHECK_MS = 1000


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def serve(address: str, parent_pid: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    encoder = msgspec.msgpack.Encoder()
    config = msgspec.msgpack.decode(sock.recv(), type=EngineConfig)
    try:
        from heron.worker.worker import Worker

        worker = Worker(config)
    except Exception as exc:  # noqa: BLE001 - reported to the core, which fails to start
        logger.exception("worker startup failed")
        sock.send(encoder.encode(WorkerStartupFailed(_describe(exc))))
        return
    sock.send(encoder.encode(worker.info()))
    decoder = msgspec.msgpack.Decoder(CoreMsg)
    while True:
        if not sock.poll(PARENT_CHECK_MS):
            if os.getppid() != parent_pid:
                return
            continue
        sched = decoder.decode(sock.recv())
        try:
            reply = worker.execute_model(sched)
        except Exception as exc:  # noqa: BLE001 - the core isolates the requests to blame
            logger.exception("step failed in the worker")
            reply = StepFailed(_describe(exc))
        sock.send(encoder.encode(reply))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the core's to handle
    logging.basicConfig(level=logging.INFO, format="%(asctime)s heron-worker %(message)s")
    serve(sys.argv[1], int(sys.argv[2]))


if __name__ == "__main__":
    main()
