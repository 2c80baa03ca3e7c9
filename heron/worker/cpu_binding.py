"""Pinning a CPU rank's torch threads to cores (``HERON_CPU_OMP_THREADS_BIND``, after vLLM's
``VLLM_CPU_OMP_THREADS_BIND``).

vLLM pins each OpenMP thread to a core; heron leaves placement to the OS unless asked. Pinned,
a thread is never moved nor parked beside another compute thread; unpinned, a thread can flee
a core that other work has taken, which on a busy shared machine matters more (measured in
``benchmarks/results/threads.md``). The spec:

* ``nobind`` (default): no pinning;
* ``auto``: rank r of a node's R ranks, T threads each, takes T of the cores it may run on,
  counted from the last (the first core stays for the API server when there is one spare);
* ``0-3`` or ``0,2,4,6``: the cores, in thread order; ``0-1|2-3``: one list per local rank.
"""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> list[int]:
    """``"0-2,5"`` -> [0, 1, 2, 5]."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"HERON_CPU_OMP_THREADS_BIND: {text!r} is not a CPU list "
                             "such as 0-3 or 0,2,4") from None
        cpus.extend(range(lo, hi + 1))
    return cpus


def cpus_for_rank(spec: str | None, threads: int, local_rank: int, ranks_per_node: int,
                  allowed: list[int] | None = None) -> list[int] | None:
    """The cores for this rank's ``threads`` threads, in thread order; None: do not pin."""
    spec = (spec or "nobind").strip()
    if spec == "nobind":
        return None
    allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if spec == "auto":
        end = len(allowed) - threads * (ranks_per_node - 1 - local_rank)
        cpus = allowed[max(0, end - threads):end]
    else:
        lists = spec.split("|")
        if len(lists) not in (1, ranks_per_node):
            raise ValueError(f"HERON_CPU_OMP_THREADS_BIND: {len(lists)} lists for "
                             f"{ranks_per_node} ranks on this node")
        cpus = parse_cpu_list(lists[local_rank if len(lists) > 1 else 0])
    if len(cpus) != threads:
        raise ValueError(f"HERON_CPU_OMP_THREADS_BIND={spec!r}: {len(cpus)} cores for "
                         f"{threads} threads of rank {local_rank} ({allowed} allowed)")
    if not set(cpus) <= set(allowed):
        raise ValueError(f"HERON_CPU_OMP_THREADS_BIND={spec!r}: cores {sorted(set(cpus) - set(allowed))} "
                         f"are not among those this process may use ({allowed})")
    return cpus
