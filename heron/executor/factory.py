"""The executor an engine config asks for (``--distributed-executor-backend``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from heron.config import EngineConfig
from heron.executor.base import Executor

if TYPE_CHECKING:
    from heron.loader.model_source import ModelSource


def make_executor(config: EngineConfig, source: ModelSource | None = None) -> Executor:
    """``mp``: a worker process per rank; ``uni``: the worker in this process. Each is
    imported only when chosen (the multiprocess one brings ZMQ and process management).
    ``source``: the model as the core resolved it, so the in-process worker does not resolve
    it again (a worker process resolves it once for itself)."""
    if config.executor_backend == "mp":
        from heron.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from heron.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config, source)
