"""Messages between a core and its worker ranks, besides the step messages themselves.

A rank connects and says ``Hello``; the core answers with the engine config; the rank loads
and answers ``WorkerInfo`` (or ``WorkerStartupFailed``). Then, for every step, each rank
answers once: the driver with the step's ``ModelRunnerOutput``, the others with ``StepDone``
(or any of them ``StepFailed``). Heartbeats are empty frames on a second connection.
"""

from __future__ import annotations

from typing import Union

import msgspec

from heron.worker.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo


class Hello(msgspec.Struct, tag=True):
    rank: int


class StepDone(msgspec.Struct, tag=True):
    """A rank that is not the driver ran its part of step ``step_id``."""

    step_id: int


class StepFailed(msgspec.Struct, tag=True):
    message: str  # "ExceptionType: message" of what the step raised
    step_id: int = 0


class WorkerStartupFailed(msgspec.Struct, tag=True):
    message: str


class Shutdown(msgspec.Struct, tag=True):
    """The core is stopping: a rank exits (ranks on other nodes have no parent to watch)."""


class CollectStats(msgspec.Struct, tag=True):
    """Ask every rank for its ``RankStats`` (between steps)."""


class RankStats(msgspec.Struct, tag=True):
    """One rank's totals since it started: steps run, time inside them, and of that time
    the part spent in collectives and in pipeline send / recv (waiting for peers included)."""

    rank: int
    steps: int
    busy_s: float
    collective_s: float
    collective_bytes: int
    collective_calls: int
    p2p_s: float
    p2p_bytes: int


WorkerMsg = Union[Hello, WorkerInfo, ModelRunnerOutput, StepDone, StepFailed,
                  WorkerStartupFailed, RankStats]
CoreMsg = Union[SchedulerOutput, CollectStats, Shutdown]
