"""The policy interface: a policy picks one worker among the available ones for a request.

Policies are small classes: ``pick`` is synchronous and fast (it runs on the router's event
loop for every request); state a policy learns from the outside (KV events, a prefix tree) is
fed by its own background tasks (``start``/``stop``) or by the hooks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from heron.route.workers import WorkerState


@dataclass
class RouteRequest:
    """What a policy may look at: the endpoint, the parsed body (after the input guards) and
    the prompt as text."""

    endpoint: str  # "completions" | "chat"
    body: dict  # the parsed JSON body (after guards)
    text: str  # completions: the prompt (a list: its first element; token ids: ""); chat: the
    # messages' text contents joined with "\n"
    cache_salt: str | None  # body.get("cache_salt")
    prompt_tokens: int  # an estimate (len(text) // 4 + 1) unless a policy refines it


@dataclass
class Decision:
    """The worker a policy picked, and why (the ``reason`` label of the routing metric)."""

    worker: "WorkerState"
    reason: str  # "round_robin", "random", "power_of_two", "least_load", "cache_hit",
    # "balance_override", "no_hit", "fallback"
    predicted_hit_tokens: int = 0  # prompt tokens the policy expects the worker to have cached


class Policy(ABC):
    """Picks a worker. Contract: ``pick`` gets a non-empty list of available workers
    (healthy, breaker not open) and returns one of them; it must not mutate the workers. The
    router calls ``on_routed`` once the request is dispatched to the decision's worker, and
    the worker hooks when the set of workers changes."""

    name: ClassVar[str]

    @abstractmethod
    def pick(self, request: RouteRequest, candidates: list["WorkerState"]) -> Decision:
        ...

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        """The request went to ``decision.worker``."""

    def on_worker_added(self, worker: "WorkerState") -> None:
        """A worker joined."""

    def on_worker_removed(self, worker: "WorkerState") -> None:
        """A worker left."""

    async def start(self) -> None:
        """Start background tasks (the router's lifespan calls it once)."""

    async def stop(self) -> None:
        """Stop background tasks."""
