"""Fixtures of the router tests: a pair of tiny-model `heron serve` workers per module and
`heron route` subprocesses in front of them, everything on 127.0.0.1, every wait bounded.

The workers come from ``heron.route.launch.WorkerGroup`` (unpinned, one thread each: two
cores are shared by everything), which can also kill and restart one on the same port. One
pair serves the whole session (starting it is most of these tests' time); a test that kills,
stops or saturates a worker leaves it as it found it. Each worker admits 4 requests at a time
and answers 429 beyond that (the saturation test relies on it).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import httpx
import pytest

from server_fixture import free_port, stop_process, wait_until_answering

ROUTER_STARTUP_S = 30.0


WORKER_MAX_QUEUED = 4


@pytest.fixture(scope="session")
def workers(tmp_path_factory):
    """Two workers on a tiny served model (SmolLM2's tokenizer), served as "tiny": a
    ``WorkerGroup`` (``.urls``, ``.kill(i, sig)``, ``.restart(i)``)."""
    from heron.route.launch import WorkerGroup
    from server_fixture import make_tiny_served_model

    model = make_tiny_served_model(tmp_path_factory.mktemp("route-tiny"))
    args = [str(model), "--max-model-len", "1024", "--threads", "1", "--served-model-name",
            "tiny", "--max-queued-requests", str(WORKER_MAX_QUEUED)]
    group = WorkerGroup(2, args, pin=False)
    try:
        group.start(startup_timeout_s=180.0)
    except BaseException:
        group.stop(10)
        raise
    yield group
    group.stop(30)


class RouterProcess:
    """`heron route` as a subprocess on a free port; ``stop`` sends SIGTERM (a drain) and
    returns the exit status."""

    def __init__(self, *args: str, startup_timeout: float = ROUTER_STARTUP_S) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "heron.entrypoints.cli", "route", "--port",
               str(self.port), *args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="heron-route-", suffix=".log")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True)
        if not wait_until_answering(f"{self.url}/health", self.proc, startup_timeout, 0.1):
            self.stop(5)
            raise RuntimeError(f"the router did not start: {self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log.name) as f:
            return f.read()[-chars:]

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def workers(self, headers: dict | None = None) -> list[dict]:
        return httpx.get(f"{self.url}/workers", headers=headers, timeout=5).json()["workers"]

    def stop(self, timeout: float = 30.0) -> int:
        return stop_process(self.proc, timeout)


@pytest.fixture(scope="session")
def router_process():
    """The :class:`RouterProcess` class, for module-scoped routers."""
    return RouterProcess


@pytest.fixture
def start_router():
    """``start_router(*flags)`` -> a RouterProcess; each one is stopped (and must exit 0)
    when the test ends."""
    started: list[RouterProcess] = []

    def start(*args: str) -> RouterProcess:
        router = RouterProcess(*args)
        started.append(router)
        return router

    yield start
    codes = [(r.stop(), r) for r in started]
    for code, router in codes:
        assert code == 0, f"router exited {code}: {router.log_tail()}"


@pytest.fixture(scope="session")
def metric_value():
    """``metric_value(text, name, **labels)``: see :func:`sum_metric`."""
    return sum_metric


def sum_metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
