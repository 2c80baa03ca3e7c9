"""Messages between a core and its worker ranks, besides the step messages themselves.

A rank connects and says ``Hello``; the core answers with the engine config; the rank loads
and answers ``WorkerInfo`` (or ``WorkerStartupFailed``). Then, for every step, each rank
answers once with ``StepDone`` (its ``RankStats`` after the step; the driver's also carries
the step's ``ModelRunnerOutput``) or ``StepFailed``. Heartbeats are empty frames on a second
connection.
"""

from __future__ import annotations

from typing import Union

import msgspec

from heron.worker.rank_stats import RankStats
from heron.worker.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo


class Hello(msgspec.Struct, tag=True):
    rank: int


class StepDone(msgspec.Struct, tag=True):
    """A rank ran its part of step ``step_id``: its totals after it, and on the driver (the
    rank that samples) the step's outcome."""

    step_id: int
    stats: RankStats
    output: ModelRunnerOutput | None = None


class StepFailed(msgspec.Struct, tag=True):
    message: str  # "ExceptionType: message" of what the step raised
    step_id: int = 0


class WorkerStartupFailed(msgspec.Struct, tag=True):
    message: str


class Shutdown(msgspec.Struct, tag=True):
    """The core is stopping: a rank exits (ranks on other nodes have no parent to watch)."""


WorkerMsg = Union[Hello, WorkerInfo, StepDone, StepFailed, WorkerStartupFailed]
CoreMsg = Union[SchedulerOutput, Shutdown]
