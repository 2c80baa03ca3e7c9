"""Messages between a core and a worker process, besides the step messages themselves."""

from __future__ import annotations

from typing import Union

import msgspec

from heron.worker.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo


class StepFailed(msgspec.Struct, tag=True):
    message: str  # "ExceptionType: message" of what the step raised


class WorkerStartupFailed(msgspec.Struct, tag=True):
    message: str


WorkerMsg = Union[WorkerInfo, ModelRunnerOutput, StepFailed, WorkerStartupFailed]
CoreMsg = SchedulerOutput
