"""Workers in processes of their own, fed encoded step messages over a ZMQ PAIR socket.

The core sends one ``SchedulerOutput`` and waits for its ``ModelRunnerOutput`` (or a
``StepFailed`` carrying what the step raised, which the core then isolates like any failed
step). A worker that exits or stops answering is an ``EngineFault``. Started as a plain
subprocess (``python -m heron.executor.worker_process``), not a multiprocessing child: the
engine core may itself be a daemonic process, which may not have children. World size 1
today; tensor parallelism adds ranks here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref

import msgspec
import zmq

from heron.config import EngineConfig
from heron.errors import EngineFault
from heron.executor.base import Executor
from heron.executor.wire import StepFailed, WorkerMsg, WorkerStartupFailed
from heron.worker.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo

POLL_MS = 200  # how often a waiting core checks that its worker is alive
STARTUP_TIMEOUT_S = 600.0  # loading weights and sizing the cache


class WorkerStepError(RuntimeError):
    """A step raised inside a worker process (the worker goes on)."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="heron-worker-")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self._tmpdir}/rank0"
        self._sock.bind(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerMsg)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "heron.executor.worker_process", address, str(os.getpid())])
        # an executor dropped without shutdown() (or at exit) still stops its worker
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._ctx, self._sock,
                                           self._tmpdir)
        try:
            self._sock.send(msgspec.msgpack.encode(config))
            info = self._receive(STARTUP_TIMEOUT_S)
            if isinstance(info, WorkerStartupFailed):
                raise RuntimeError(f"the worker failed to start: {info.message}")
            assert isinstance(info, WorkerInfo)
            self.info = info
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._sock.send(self._encoder.encode(sched))
        reply = self._receive(None)
        if isinstance(reply, StepFailed):
            raise WorkerStepError(reply.message)
        assert isinstance(reply, ModelRunnerOutput)
        return reply

    def _receive(self, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._sock.poll(POLL_MS):
            if self._proc.poll() is not None:
                raise EngineFault(f"the worker process exited (code {self._proc.returncode})")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineFault(f"the worker did not answer within {timeout:.0f} s")
        return self._decoder.decode(self._sock.recv())

    @property
    def pid(self) -> int:
        return self._proc.pid

    def shutdown(self) -> None:
        self._finalizer()


def _stop(proc: subprocess.Popen, ctx: zmq.Context, sock: zmq.Socket, tmpdir: str) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    sock.close()
    ctx.term()
    shutil.rmtree(tmpdir, ignore_errors=True)
