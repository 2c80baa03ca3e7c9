"""`heron route --launch N`: start N `heron serve` workers on this machine, wired for the router.

Each worker gets its own HTTP port and its own KV-events endpoint (``--kv-events-endpoint
tcp://HOST:PORT``, the feed the cache-aware policy subscribes to), and its share of the cores:
the process and everything it starts (the engine core, its ranks) is pinned with
``sched_setaffinity`` before it executes, and its torch threads (``--threads``) and
``OMP_NUM_THREADS`` follow heron's own rule on that share (``heron.config.default_cpu_threads``:
all cores of the share but one, at least one). N workers on fewer cores than N share them
round robin, one core each.

Torch-free: the workers are subprocesses; this module only starts, waits for and stops them.
Each worker leads its own process group (a terminal's Ctrl-C reaches the launcher, which stops
them in order) and gets SIGTERM if the launcher dies.
Every wait is bounded: ``/health`` within ``startup_timeout_s`` (a worker that exits or stays
silent fails the launch, and the others are stopped), SIGTERM at exit (a worker drains), then
SIGKILL to its whole process group after ``stop_timeout_s``.

    with launch_workers(2, ["--max-model-len", "2048"]) as workers:
        urls = [w.url for w in workers]          # then the router in front of them

``WorkerGroup`` is the same with a hand on each worker (kill, restart: benchmarks, tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from heron.config import default_cpu_threads

logger = logging.getLogger("heron.route.launch")

# flags the launcher sets for each worker; a serve argument list naming them is refused
OWNED_FLAGS = ("--host", "--port", "--kv-events-endpoint")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class LaunchedWorker:
    """One started worker: where it answers, where it publishes KV events, its cores."""

    index: int
    url: str
    port: int
    kv_events_endpoint: str
    cpus: tuple[int, ...]
    threads: int
    pid: int
    log_path: str


def split_cpus(n: int, cpus: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """``n`` shares of ``cpus`` (default: the cores this process may run on): contiguous and
    as even as possible (the first shares take the remainder); with fewer cores than
    workers, one core each, round robin."""
    if n < 1:
        raise ValueError(f"--launch needs at least one worker, got {n}")
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not cpus:
        raise ValueError("no cores to pin the workers to")
    if n >= len(cpus):
        return [(cpus[i % len(cpus)],) for i in range(n)]
    size, extra = divmod(len(cpus), n)
    shares, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        shares.append(tuple(cpus[start:end]))
        start = end
    return shares


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports the OS calls free now (all bound at once, so no repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ports(n: int, base: int | None, host: str, avoid: Sequence[int] = ()) -> list[int]:
    if base is not None:
        return [base + i for i in range(n)]
    for _ in range(100):  # the OS's picks, drawn again while one clashes with ``avoid``
        ports = free_ports(n, host)
        if not set(ports) & set(avoid):
            return ports
    raise RuntimeError(f"no {n} free ports on {host} apart from {list(avoid)}")


def _check_serve_args(serve_args: Sequence[str]) -> None:
    for arg in serve_args:
        name = arg.split("=", 1)[0]
        if name in OWNED_FLAGS:
            raise ValueError(f"{name}: `heron route --launch` sets it for each worker "
                             f"(its own port and KV-events endpoint)")


def worker_command(serve_args: Sequence[str], host: str, port: int, kv_endpoint: str,
                   threads: int | None, python: str | None = None) -> list[str]:
    """The `heron serve` command line of one worker (``threads`` None: the serve args'
    own ``--threads``)."""
    cmd = [python or sys.executable, "-m", "heron.entrypoints.cli", "serve", *serve_args,
           "--host", host, "--port", str(port), "--kv-events-endpoint", kv_endpoint]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    return cmd


def _given_threads(serve_args: Sequence[str]) -> int | None:
    for i, arg in enumerate(serve_args):
        if arg == "--threads" and i + 1 < len(serve_args):
            return int(serve_args[i + 1])
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
    return None


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def _health(url: str) -> bool:
    try:
        with _NO_PROXY.open(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(path: str, chars: int = 3000) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()[-chars:]
    return ""


def _group_running(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run (zombies left out: an orphan's
    zombie waits for init, not for us)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def stop_workers(procs: Sequence[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM every worker still running (each drains and stops its engine), wait for all
    up to ``timeout_s`` together, then SIGKILL the process group of any worker, or of any
    process a worker left behind, still running (each worker leads its own group)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("worker pid %d did not stop within %.0f s of SIGTERM: SIGKILL",
                           proc.pid, timeout_s)
        while _group_running(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # its engine (same group) finishing its own shutdown
        if _group_running(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def _wait_healthy(workers: Sequence[LaunchedWorker], procs: Sequence[subprocess.Popen | None],
                  indices: Sequence[int], timeout_s: float) -> None:
    """Returns once workers ``indices`` answer /health 200; RuntimeError when one exits or
    the time is up (the caller stops them)."""
    deadline, pending = time.monotonic() + timeout_s, set(indices)
    while pending:
        for i in sorted(pending):
            if procs[i].poll() is not None:
                raise RuntimeError(f"worker {i} ({workers[i].url}) exited with code "
                                   f"{procs[i].returncode} while starting; its log "
                                   f"({workers[i].log_path}) ends:\n"
                                   f"{_log_tail(workers[i].log_path)}")
            if _health(workers[i].url):
                pending.discard(i)
                logger.info("worker %d ready at %s (cores %s)", i, workers[i].url,
                            ",".join(map(str, workers[i].cpus)))
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"workers {sorted(pending)} did not answer /health within "
                               f"{timeout_s:.0f} s; logs: "
                               + ", ".join(workers[i].log_path for i in sorted(pending)))
        if pending:
            time.sleep(0.25)


class WorkerGroup:
    """N planned `heron serve` workers (ports, endpoints, cores fixed at construction):
    ``start`` them, ``kill`` / ``restart`` one (same port, endpoint and cores), ``stop`` all.
    Arguments as :func:`launch_workers`."""

    def __init__(self, n: int, serve_args: Sequence[str] = (), *, host: str = "127.0.0.1",
                 base_port: int | None = None, kv_base_port: int | None = None,
                 cpus: Sequence[int] | None = None, pin: bool = True,
                 log_dir: str | os.PathLike | None = None, python: str | None = None,
                 env: dict[str, str] | None = None,
                 gpus: Sequence[str] | None = None) -> None:
        _check_serve_args(serve_args)
        self.serve_args, self.host, self.python = list(serve_args), host, python
        self.env, self.gpus = dict(env or {}), list(gpus or [])
        shares = split_cpus(n, cpus) if pin else [() for _ in range(n)]
        self._given_threads = _given_threads(serve_args)
        ports = _ports(n, base_port, host)
        kv_ports = _ports(n, kv_base_port, host, avoid=ports)
        logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="heron-route-"
                                                                    "workers-"))
        logs.mkdir(parents=True, exist_ok=True)
        self.workers = [
            LaunchedWorker(i, f"http://{host}:{port}", port, f"tcp://{host}:{kv_port}",
                           tuple(share), self._given_threads or
                           (default_cpu_threads(1, len(share))[0] if share else 0),
                           0, str(logs / f"worker-{i}.log"))
            for i, (share, port, kv_port) in enumerate(zip(shares, ports, kv_ports))]
        self.procs: list[subprocess.Popen | None] = [None] * n

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def spawn(self, i: int) -> LaunchedWorker:
        """Start worker ``i`` (no wait); its log file starts over."""
        w = self.workers[i]
        threads = None if self._given_threads else (w.threads or None)
        cmd = worker_command(self.serve_args, self.host, w.port, w.kv_events_endpoint,
                             threads, self.python)
        env = {**os.environ, **self.env}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[i % len(self.gpus)]
        if w.threads:
            env.update({k: str(w.threads) for k in THREAD_ENV})
        with open(w.log_path, "w") as log:
            # own session: the terminal's Ctrl-C reaches the launcher, which stops the
            # workers in order; SIGKILL can take the whole group
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                    preexec_fn=_child_setup(w.cpus))
        self.procs[i] = proc
        self.workers[i] = w = dataclasses.replace(w, pid=proc.pid)
        logger.info("worker %d: pid %d, %s, KV events %s, cores %s, log %s", i, proc.pid,
                    w.url, w.kv_events_endpoint, ",".join(map(str, w.cpus)) or "any",
                    w.log_path)
        return w

    def start(self, startup_timeout_s: float = 600.0) -> list[LaunchedWorker]:
        """Start every worker and wait until all answer /health (RuntimeError if one exits
        or the time is up: the caller stops the group)."""
        for i in range(len(self.workers)):
            self.spawn(i)
        self.wait_healthy(range(len(self.workers)), startup_timeout_s)
        return list(self.workers)

    def wait_healthy(self, indices: Iterable[int], timeout_s: float) -> None:
        _wait_healthy(self.workers, self.procs, list(indices), timeout_s)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``i``'s process group (SIGKILL: it and its engine die at
        once, as a crash); reaped when it is SIGKILL."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            if sig == signal.SIGKILL:
                proc.wait(10)

    def restart(self, i: int, startup_timeout_s: float = 600.0,
                stop_timeout_s: float = 30.0) -> LaunchedWorker:
        """Stop worker ``i`` if it runs, start it again on the same port, endpoint and
        cores, and wait for its /health."""
        stop_workers([p for p in self.procs[i:i + 1] if p is not None], stop_timeout_s)
        self.spawn(i)
        self.wait_healthy([i], startup_timeout_s)
        return self.workers[i]

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_workers([p for p in self.procs if p is not None], timeout_s)


@contextlib.contextmanager
def launch_workers(n: int, serve_args: Sequence[str] = (), *, host: str = "127.0.0.1",
                   base_port: int | None = None, kv_base_port: int | None = None,
                   cpus: Sequence[int] | None = None, pin: bool = True,
                   startup_timeout_s: float = 600.0, stop_timeout_s: float = 30.0,
                   log_dir: str | os.PathLike | None = None, python: str | None = None,
                   env: dict[str, str] | None = None,
                   gpus: Sequence[str] | None = None) -> Iterator[list[LaunchedWorker]]:
    """Start ``n`` `heron serve` workers, yield them once all answer /health, stop them on exit.

    ``serve_args``: `heron serve` flags for every worker (a model path, ``--max-model-len``,
    ...), without ``--host`` / ``--port`` / ``--kv-events-endpoint``, which this sets.
    ``base_port`` / ``kv_base_port``: worker i listens on base + i and publishes on
    ``tcp://host:kv_base + i`` (None: free ports). ``cpus``: the cores to share out (default:
    this process's); ``pin=False`` leaves placement and thread counts to heron. Logs go to
    ``log_dir/worker-i.log`` (default: a new temporary directory, kept). ``env``: extra
    environment for the workers; ``gpus``: CUDA device ids, worker i gets
    ``CUDA_VISIBLE_DEVICES=gpus[i % len(gpus)]`` (default: the environment's). The first
    worker that fails to start stops them all and raises RuntimeError; a bad argument raises
    ValueError before anything starts.
    """
    group = WorkerGroup(n, serve_args, host=host, base_port=base_port,
                        kv_base_port=kv_base_port, cpus=cpus, pin=pin, log_dir=log_dir,
                        python=python, env=env, gpus=gpus)
    try:
        yield group.start(startup_timeout_s)
    finally:
        group.stop(stop_timeout_s)


_PR_SET_PDEATHSIG = 1


def _child_setup(cpus: tuple[int, ...]):
    """Runs in each worker between fork and exec: the core mask (every thread it starts and
    every process it forks inherits it), and SIGTERM when the launcher dies (a router killed
    with SIGKILL leaves no workers behind; they drain as on any SIGTERM). Fork from the main
    thread: the death signal follows the thread that forked."""
    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    return setup
