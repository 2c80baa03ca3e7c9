"""Executors: how the engine core drives its workers with step messages (``heron.worker.step``).

``uni``: one worker in the core's own process (the default, and the offline API's); ``mp``:
one worker process per rank, fed encoded steps over a pipe (ranks > 1 come with tensor
parallelism). vLLM's names (``--distributed-executor-backend``).
"""

from __future__ import annotations

from heron.executor.base import EXECUTOR_BACKENDS, Executor
from heron.executor.factory import make_executor

__all__ = ["EXECUTOR_BACKENDS", "Executor", "make_executor"]
