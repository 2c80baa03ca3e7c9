"""The load-only policies: round robin, random, power of two choices, least load."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from heron.route.policies.base import Decision, Policy, RouteRequest

if TYPE_CHECKING:
    from heron.route.workers import WorkerState


class RoundRobinPolicy(Policy):
    """Each request goes to the next candidate in turn (a counter modulo the candidates, so
    with a stable set of workers they alternate exactly)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, request: RouteRequest, candidates: list["WorkerState"]) -> Decision:
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(worker, self.name)


class RandomPolicy(Policy):
    """A uniformly random candidate."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, request: RouteRequest, candidates: list["WorkerState"]) -> Decision:
        return Decision(self._rng.choice(candidates), self.name)


class PowerOfTwoPolicy(Policy):
    """Two random candidates; the one with fewer outstanding requests (ties: the first)."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, request: RouteRequest, candidates: list["WorkerState"]) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], self.name)
        a, b = self._rng.sample(candidates, 2)
        return Decision(b if b.outstanding_requests < a.outstanding_requests else a, self.name)


class LeastLoadPolicy(Policy):
    """The candidate with the fewest outstanding prompt tokens (then requests, then the
    worker's own queue); ties go to the earliest-added worker."""

    name = "least_load"

    def pick(self, request: RouteRequest, candidates: list["WorkerState"]) -> Decision:
        worker = min(candidates, key=lambda w: (w.outstanding_tokens, w.outstanding_requests,
                                                w.waiting_requests))
        return Decision(worker, self.name)
