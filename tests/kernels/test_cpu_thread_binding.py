"""HERON_CPU_OMP_THREADS_BIND pins a CPU rank's torch threads (``heron_cpu.bind_threads``).
Each check runs in a child process: pinning the test process would pin the rest of the run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from heron.kernels import cpu

_THREAD_CORES = """
import os, torch
from heron.kernels import cpu
assert cpu.load()
torch.set_num_threads({threads})
torch.ops.heron_cpu.bind_threads({cpus})
torch.ones(1 << 16).sum()  # a parallel region: the pool's threads are up
main = os.sched_getaffinity(0)
others = []
for task in os.listdir("/proc/self/task"):
    status = open(f"/proc/self/task/{{task}}/status").read()
    cores = [l.split()[1] for l in status.splitlines() if l.startswith("Cpus_allowed_list")][0]
    others.append(cores)
print(repr((sorted(main), others)))
"""


def _run(code: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(autouse=True)
def kernels():
    assert cpu.load()


def test_each_thread_is_pinned_to_its_core():
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[-2:] if len(allowed) > 1 else allowed
    main, tasks = eval(_run(_THREAD_CORES.format(threads=len(cpus), cpus=cpus[::-1])))
    assert main == [cpus[-1]]  # thread 0 (the caller) takes the first listed core
    for core in cpus:  # every listed core holds a thread pinned to it alone
        assert str(core) in tasks


def test_a_core_count_that_differs_from_the_threads_is_refused():
    code = _THREAD_CORES.format(threads=2, cpus=[0])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode != 0 and "1 CPUs for 2 threads" in out.stderr


def test_the_engine_pins_its_threads_when_asked(tiny):
    code = (f"import os; from heron import LLM; LLM({str(tiny.path)!r}, num_threads=1, "
            "num_kv_blocks=32); print(sorted(os.sched_getaffinity(0)))")
    last = sorted(os.sched_getaffinity(0))[-1]
    assert _run(code, {"HERON_CPU_OMP_THREADS_BIND": "auto"}) == f"[{last}]"
    assert _run(code, {"HERON_CPU_OMP_THREADS_BIND": "nobind"}) == \
        str(sorted(os.sched_getaffinity(0)))
