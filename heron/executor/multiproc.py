"""Worker ranks in processes of their own, fed encoded step messages over ZMQ.

The core binds one ROUTER socket; each rank connects a DEALER named by its rank (and a
second one for heartbeats). A step is encoded once and sent to every rank; every rank
answers once with a ``StepDone`` (the driver's, TP rank 0 of the last pipeline stage, with
the step's ``ModelRunnerOutput``; every one with its rank's busy and communication totals,
kept for ``rank_stats()``) or a ``StepFailed`` with what the step raised. All ranks failing
is a failed step (the core isolates the requests to blame); some failing is an
``EngineFault`` (the ranks diverged), as is a rank that exits, misses heartbeats, or does not
answer within the collective timeout.

Up to ``pipeline_parallel_size`` steps may be in flight (``submit`` / ``collect``, in order):
pipeline stages then work on different steps at once.

Ranks start as plain subprocesses (``python -m heron.executor.worker_process``), not
multiprocessing children: the engine core may itself be a daemonic process, which may not
have children. Ranks on other nodes (``nnodes > 1``) are started there and connect over TCP.
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
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
from heron.executor.wire import (Hello, Shutdown, StepDone, StepFailed, WorkerMsg,
                                 WorkerStartupFailed)
from heron.worker.rank_stats import RankStats
from heron.worker.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo

POLL_MS = 100  # how often a waiting core checks that its ranks are alive
STARTUP_TIMEOUT_S = 600.0  # loading weights and sizing the cache
HEARTBEAT_TIMEOUT_S = 10.0  # a rank silent this long (heartbeats every 0.5 s) is gone


class WorkerStepError(RuntimeError):
    """A step raised inside the worker ranks (they go on)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_address(config: EngineConfig, tmpdir: str) -> str:
    """Where the core binds its step socket and the ranks connect: a local socket file, or
    master_addr:master_port+1 for several nodes (ParallelConfig requires the port then)."""
    par = config.parallel
    if par.nnodes == 1:
        return f"ipc://{tmpdir}/core"
    return f"tcp://{par.master_addr}:{par.master_port + 1}"


def init_method(config: EngineConfig) -> str:
    par = config.parallel
    return f"tcp://{par.master_addr}:{par.master_port or free_port()}"


def run_node_ranks(config: EngineConfig) -> int:
    """Node ``node_rank`` > 0 of a multi-node world: start this node's ranks, which connect
    to the core on node 0, and wait for them (they exit when the core goes)."""
    par = config.parallel
    first = par.node_rank * par.ranks_per_node
    procs = spawn_ranks(range(first, first + par.ranks_per_node), core_address(config, ""),
                        init_method(config), 0)
    codes = [proc.wait() for proc in procs]
    return max(codes, default=0)


def spawn_ranks(ranks: range, address: str, method: str, parent_pid: int
                ) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "heron.executor.worker_process", address,
                              str(rank), method, str(parent_pid)]) for rank in ranks]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        par = config.parallel
        self.world_size = par.world_size
        self.max_in_flight = par.pipeline_parallel_size
        self.step_timeout_s = par.collective_timeout_s + 10.0
        self._tmpdir = tempfile.mkdtemp(prefix="heron-worker-")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        address = core_address(config, self._tmpdir)
        self._sock.bind(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerMsg)
        self._last_seen: dict[int, float] = {}  # rank -> last message (after its hello)
        # replies that arrived ahead of their step (a rank that finished step k + 1 before
        # another finished step k), per rank in order
        self._early: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._in_flight: collections.deque[int] = collections.deque()  # step ids, in order
        self._rank_stats = [RankStats(rank) for rank in range(self.world_size)]
        self._procs = spawn_ranks(range(par.ranks_per_node), address, init_method(config),
                                  os.getpid())
        # an executor dropped without shutdown() (or at exit) still stops its ranks
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._ctx, self._sock,
                                           self._tmpdir, self.world_size)
        try:
            self.info = self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig) -> WorkerInfo:
        """Hello from every rank -> the config to each -> WorkerInfo from each."""
        for rank in self._receive_all(STARTUP_TIMEOUT_S, Hello):
            self._send(rank, msgspec.msgpack.encode(config))
        infos = self._receive_all(STARTUP_TIMEOUT_S, WorkerInfo)
        failed = [m for m in infos.values() if isinstance(m, WorkerStartupFailed)]
        if failed:
            raise RuntimeError(f"a worker failed to start: {failed[0].message}")
        driver = infos[config.parallel.driver_rank]  # see Worker.is_driver
        self.driver_rank = driver.rank
        self.bytes_read = {rank: info.bytes_read for rank, info in infos.items()}
        return msgspec.structs.replace(driver, weight_bytes=sum(
            info.weight_bytes for info in infos.values()))  # every rank's share

    # ---- steps -------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(sched)
        return self.collect()

    def submit(self, sched: SchedulerOutput) -> None:
        frame = self._encoder.encode(sched)  # encoded once, sent to every rank
        for rank in range(self.world_size):
            self._send(rank, frame)
        self._in_flight.append(sched.step_id)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def collect(self) -> ModelRunnerOutput:
        """The outcome of the oldest submitted step."""
        step_id = self._in_flight.popleft()
        replies = self._receive_all(self.step_timeout_s, StepDone)
        for rank, msg in replies.items():
            if isinstance(msg, StepDone):
                self._rank_stats[rank] = msg.stats
        failed = {rank: m for rank, m in replies.items() if isinstance(m, StepFailed)}
        if failed and len(failed) < self.world_size:
            rank, msg = next(iter(failed.items()))
            raise EngineFault(f"worker rank {rank} failed step {step_id} alone ({msg.message}):"
                              f" the ranks diverged")
        if failed:
            raise WorkerStepError(failed[self.driver_rank].message)
        output = replies[self.driver_rank].output
        assert isinstance(output, ModelRunnerOutput)
        return output

    def rank_stats(self) -> list[RankStats]:
        """Every rank's totals as of the last step it answered, by rank."""
        return list(self._rank_stats)

    # ---- transport -----------------------------------------------------------------------
    def _send(self, rank: int, payload: bytes) -> None:
        self._sock.send_multipart([str(rank).encode(), payload], copy=False)

    def _receive_all(self, timeout: float, expected) -> dict[int, WorkerMsg]:
        """One message from every rank (``expected`` types, or a failure report)."""
        replies: dict[int, WorkerMsg] = {rank: queue.popleft()
                                         for rank, queue in self._early.items() if queue}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            if not self._sock.poll(POLL_MS):
                self._check_alive()
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(replies))
                    raise EngineFault(f"worker rank(s) {missing} did not answer within "
                                      f"{timeout:.0f} s")
                continue
            got = self._recv()
            if got is None:
                continue
            rank, msg = got
            if not isinstance(msg, (expected, StepFailed, WorkerStartupFailed)):
                raise EngineFault(f"worker rank {rank} sent an unexpected {type(msg).__name__}")
            if rank in replies:
                self._early[rank].append(msg)
            else:
                replies[rank] = msg
        return replies

    def _recv(self) -> tuple[int, WorkerMsg] | None:
        """The next message: (rank, message), or None for a heartbeat."""
        identity, payload = self._sock.recv_multipart()
        rank = self._rank_of(identity)
        self._last_seen[rank] = time.monotonic()
        if identity.startswith(b"hb"):
            return None
        return rank, self._decoder.decode(payload)

    def check_health(self) -> None:
        """EngineFault if a rank exited or stopped sending heartbeats (for an idle core)."""
        while self._sock.poll(0):
            got = self._recv()
            if got is not None:
                self._early[got[0]].append(got[1])
        self._check_alive()

    @staticmethod
    def _rank_of(identity: bytes) -> int:
        return int(identity[2:] if identity.startswith(b"hb") else identity)

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.poll() is not None:
                raise EngineFault(f"worker rank {rank} exited (code {proc.returncode})")
        now = time.monotonic()
        silent = [r for r, seen in self._last_seen.items() if now - seen > HEARTBEAT_TIMEOUT_S]
        if silent:
            raise EngineFault(f"worker rank {silent[0]} sent no heartbeat for "
                              f"{HEARTBEAT_TIMEOUT_S:.0f} s")

    @property
    def pid(self) -> int:
        return self._procs[0].pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self) -> None:
        self._finalizer()


def _stop(procs: list[subprocess.Popen], ctx: zmq.Context, sock: zmq.Socket,
          tmpdir: str, world_size: int) -> None:
    shutdown = msgspec.msgpack.encode(Shutdown())
    for rank in range(world_size):  # ranks on other nodes exit on it (best effort)
        try:
            sock.send_multipart([str(rank).encode(), shutdown], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    sock.setsockopt(zmq.LINGER, 500)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    sock.close()
    ctx.term()
    shutil.rmtree(tmpdir, ignore_errors=True)
