"""The scheduler's plain-data step seen with its request objects, and a fake worker: for
tests that drive the scheduler without a model, the way ``EngineCore.step`` drives it."""

from __future__ import annotations

from dataclasses import dataclass

from heron.engine.request import Request
from heron.engine.scheduler import ScheduledRequest, Scheduler
from heron.worker.step import ModelRunnerOutput, SchedulerOutput


@dataclass
class StepView:
    """``message`` (what the worker receives) with the core's request objects."""

    message: SchedulerOutput
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return self.message.total_num_scheduled_tokens

    @property
    def is_empty(self) -> bool:
        return self.message.is_empty


def schedule(sched: Scheduler) -> StepView:
    out = sched.schedule()
    return StepView(out, [ScheduledRequest(sched.requests[r], n)
                          for r, n in zip(out.req_ids, out.num_scheduled_tokens)],
                    [sched.requests[r] for r in out.preempted_req_ids])


def fake_output(view: StepView, token) -> ModelRunnerOutput:
    """What a worker returns: ``token(request)`` for every sequence whose step samples."""
    sampled = [[token(s.request)] if s.samples else [] for s in view.scheduled]
    return ModelRunnerOutput(list(view.message.req_ids), sampled, [None] * len(sampled))


def complete(sched: Scheduler, view: StepView, token=lambda request: 7) -> list:
    """Apply the fake worker's outcome (append, token stops, cache full blocks)."""
    return sched.update_from_output(view.message, fake_output(view, token))
