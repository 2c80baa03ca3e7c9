"""The executor seam: the engine core hands it a step, it returns the step's outcome."""

from __future__ import annotations

import abc
import collections

from heron.worker.rank_stats import RankStats
from heron.worker.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo

EXECUTOR_BACKENDS = ("uni", "mp")


class Executor(abc.ABC):
    """Runs steps on the model's workers. ``execute_model`` raises what the step raised (the
    core then isolates the requests to blame), or ``EngineFault`` when a worker is gone.

    ``submit`` / ``collect`` run up to ``max_in_flight`` steps at once (pipeline stages busy
    with different steps); outcomes come back in submission order. By default a step runs
    when it is collected.
    """

    info: WorkerInfo
    max_in_flight: int = 1

    def __init__(self) -> None:
        self._submitted: collections.deque[SchedulerOutput] = collections.deque()

    @abc.abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def submit(self, sched: SchedulerOutput) -> None:
        self._submitted.append(sched)

    def collect(self) -> ModelRunnerOutput:
        """The outcome of the oldest submitted step (raises what ``execute_model`` raises)."""
        return self.execute_model(self._submitted.popleft())

    @property
    def num_in_flight(self) -> int:
        return len(self._submitted)

    def rank_stats(self) -> list[RankStats]:
        """Every worker rank's totals as of its last step, by rank; empty for a worker in
        the core's own process."""
        return []

    def check_health(self) -> None:
        """Raise ``EngineFault`` if a worker is gone (called while the core is idle)."""

    def shutdown(self) -> None:
        """Release the workers; idempotent."""

