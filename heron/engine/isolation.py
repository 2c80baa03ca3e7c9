"""Fault isolation: find which requests of a failed step made it fail.

A step runs a batch of requests together; when it raises, the batch is split in halves and
each half is run again, down to single requests, so one request's bad input costs that
request alone. Re-running is safe because a step only writes KV for its own requests' slots
(the same values every time) and the scheduler applies progress only after the step
succeeds. A failure that every request of a batch shares is an engine fault, not theirs.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from heron.errors import EngineFault

__all__ = ["EngineFault", "describe", "run_isolating"]

Item = TypeVar("Item")
Result = TypeVar("Result")


def run_isolating(run: Callable[[Sequence[Item]], Result], items: Sequence[Item]
                  ) -> tuple[list[Result], list[tuple[Item, Exception]]]:
    """``run(items)``; if it raises, bisect. Returns the results of the sub-batches that
    succeeded and, per failing item, the exception it raised when run alone."""
    try:
        return [run(items)], []
    except EngineFault:
        raise  # the engine itself is broken: no request is to blame
    except Exception as exc:  # noqa: BLE001 - any failure is attributed, then reported
        if len(items) == 1:
            return [], [(items[0], exc)]
    mid = len(items) // 2
    left, left_failed = run_isolating(run, items[:mid])
    right, right_failed = run_isolating(run, items[mid:])
    return left + right, left_failed + right_failed


def describe(exc: BaseException) -> str:
    """A one-line reason for a client: the exception type and message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
