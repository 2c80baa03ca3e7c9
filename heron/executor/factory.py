"""The executor an engine config asks for (``--distributed-executor-backend``)."""

from __future__ import annotations

from heron.config import EngineConfig
from heron.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """``mp``: a worker process per rank; ``uni``: the worker in this process. Each is
    imported only when chosen (the multiprocess one brings ZMQ and process management)."""
    if config.executor_backend == "mp":
        from heron.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from heron.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)
