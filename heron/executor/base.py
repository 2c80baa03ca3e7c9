"""The executor seam: the engine core hands it a step, it returns the step's outcome."""

from __future__ import annotations

import abc

from heron.config import EngineConfig
from heron.worker.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo

EXECUTOR_BACKENDS = ("uni", "mp")


class Executor(abc.ABC):
    """Runs steps on the model's workers. ``execute_model`` raises what the step raised (the
    core then isolates the requests to blame), or ``EngineFault`` when a worker is gone."""

    info: WorkerInfo

    @abc.abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        """Release the workers; idempotent."""


def make_executor(config: EngineConfig) -> Executor:
    if config.distributed_executor_backend == "mp":
        from heron.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from heron.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)
