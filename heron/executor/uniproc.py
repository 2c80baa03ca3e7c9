"""One worker inside the engine core's process: steps are plain calls, nothing is encoded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from heron.config import EngineConfig
from heron.executor.base import Executor
from heron.worker.step import ModelRunnerOutput, SchedulerOutput
from heron.worker.worker import Worker

if TYPE_CHECKING:
    from heron.loader.model_source import ModelSource


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        super().__init__()
        self.worker = Worker(config, source=source)
        self.info = self.worker.info()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)
