"""Every environment variable heron reads, in one place (the shape of vLLM's ``envs.py``).

Read a variable as an attribute, ``envs.HERON_BATCH_INVARIANT``: each access reads the
environment anew and parses the value as the table below says, so a variable set after import
(a test's monkeypatch, a parent process before it starts a child) is seen. Nothing here writes
the environment: a module that sets a variable for its child processes does so itself
(``logging_config.configure`` writes ``HERON_LOGGING_LEVEL``, ``kernels.runtime`` sets
``TRITON_INTERPRET``).

A leaf module: it imports no heron package (and no torch).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the attributes, typed, for readers and type checkers
    HERON_LOGGING_LEVEL: str | None
    HERON_CONFIGURE_LOGGING: bool
    HERON_CACHE_DIR: Path
    HERON_FAULT_INJECTION_TOKEN: int | None
    HERON_BATCH_INVARIANT: bool
    HERON_CPU_OMP_THREADS_BIND: str | None
    HERON_CPU_ALLOCATOR_CACHE_MB: int
    HERON_VLLM_VENV: Path
    MASTER_ADDR: str
    MASTER_PORT: int | None
    TRITON_INTERPRET: bool


def _get(name: str) -> str | None:
    """The variable's value; None when it is unset or empty."""
    return os.environ.get(name) or None


def _truthy(name: str, accepted: tuple[str, ...] = ("1", "true", "yes", "on")) -> bool:
    return (os.environ.get(name) or "").strip().lower() in accepted


def _cache_mb() -> int:
    value = _int_or_none("HERON_CPU_ALLOCATOR_CACHE_MB")
    if value is not None and value < 0:
        raise ValueError(f"HERON_CPU_ALLOCATOR_CACHE_MB must be >= 0 MiB, got {value}")
    return 1024 if value is None else value


def _int_or_none(name: str) -> int | None:
    value = _get(name)
    return int(value) if value is not None else None


# name -> how to read it; the comment above each says what it does and its default
environment_variables: dict[str, Callable[[], Any]] = {
    # ---- logging ----
    # The level of the ``heron`` logger (a name, debug .. error, or a number); unset: INFO,
    # or what -v / --quiet say. The CLI writes the level it resolved back, so the engine core
    # and worker processes it starts log at the same level.
    "HERON_LOGGING_LEVEL": lambda: _get("HERON_LOGGING_LEVEL"),
    # "0": leave the ``heron`` logger alone (no handler, no format): an application that
    # configures logging itself decides. Default "1" (like VLLM_CONFIGURE_LOGGING).
    "HERON_CONFIGURE_LOGGING": lambda: os.environ.get("HERON_CONFIGURE_LOGGING", "1") != "0",

    # ---- files ----
    # Where heron caches what it derives from a model: the tokenizer directory it writes for a
    # GGUF file, the HF export of a GGUF model for the vLLM peer. Default ~/.cache/heron.
    "HERON_CACHE_DIR": lambda: Path(_get("HERON_CACHE_DIR")
                                    or Path.home() / ".cache" / "heron"),

    # ---- engine behaviour ----
    # For reliability tests: a request whose prompt holds this token id raises while its
    # output is processed (as a bug would), to show that one failing request costs only that
    # request. Default: unset (no fault is injected).
    "HERON_FAULT_INJECTION_TOKEN": lambda: _int_or_none("HERON_FAULT_INJECTION_TOKEN"),
    # "1" / "true" / "yes" / "on" (vLLM's VLLM_BATCH_INVARIANT): float32 projections also
    # give a row the same bits whatever else is in its batch (quantized layers and attention
    # always do), at some cost for small batches (``heron.layers.cpu_gemm``). Default off.
    "HERON_BATCH_INVARIANT": lambda: _truthy("HERON_BATCH_INVARIANT"),
    # Pin each CPU rank's torch threads to cores (vLLM's VLLM_CPU_OMP_THREADS_BIND): "auto"
    # (the last cores, one set per rank), a list ("0-1", "0,2"; "0-1|2-3" one per local rank)
    # or "nobind". Default: nobind (``heron.worker.cpu_binding`` says why).
    "HERON_CPU_OMP_THREADS_BIND": lambda: _get("HERON_CPU_OMP_THREADS_BIND"),
    # MiB of freed blocks a CPU worker's caching allocator may keep for reuse
    # (heron/kernels/cpu/caching_allocator.cpp: no page faults on a step's intermediates);
    # "0" leaves torch's default allocator. Default 1024.
    "HERON_CPU_ALLOCATOR_CACHE_MB": lambda: _cache_mb(),

    # ---- multi-node (torch.distributed's names; a LeaderWorkerSet sets them) ----
    # The defaults of --master-addr (127.0.0.1) and --master-port (unset: a free port, on a
    # single node only).
    "MASTER_ADDR": lambda: _get("MASTER_ADDR") or "127.0.0.1",
    "MASTER_PORT": lambda: _int_or_none("MASTER_PORT"),

    # ---- kernels ----
    # Triton's own switch: "1" runs Triton kernels in its CPU interpreter (tests); heron reads
    # it to know whether Triton kernels can run on CPU tensors. Default off.
    "TRITON_INTERPRET": lambda: _truthy("TRITON_INTERPRET"),

    # ---- benchmarks ----
    # The virtual environment holding vLLM's CPU build for `heron bench --peer vllm`.
    # Default: .venv/peers/vllm under the current directory.
    "HERON_VLLM_VENV": lambda: Path(_get("HERON_VLLM_VENV")
                                    or Path.cwd() / ".venv" / "peers" / "vllm"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(environment_variables)
