"""The load-only policies and the policy registry."""

from __future__ import annotations

import collections

import pytest

from heron.route.breaker import CircuitBreaker
from heron.route.config import RouterConfig
from heron.route.policies import SIMPLE_POLICIES, RouteRequest, make_policy
from heron.route.workers import WorkerState


def _workers(n: int) -> list[WorkerState]:
    return [WorkerState(url=f"http://w{i}:1", breaker=CircuitBreaker()) for i in range(n)]


def _req(tokens: int = 10) -> RouteRequest:
    return RouteRequest("completions", {"prompt": "x"}, "x", None, tokens)


def test_registry_knows_every_simple_policy():
    cfg = RouterConfig()
    for name in ("round_robin", "random", "power_of_two", "least_load"):
        policy = make_policy(name, cfg)
        assert policy.name == name and isinstance(policy, SIMPLE_POLICIES[name])
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope", cfg)


def test_cache_aware_loads_lazily_or_says_why():
    try:
        policy = make_policy("cache_aware", RouterConfig(policy="cache_aware"))
    except ValueError as exc:
        assert "cache_aware" in str(exc)
    else:
        assert policy.name == "cache_aware"


def test_round_robin_alternates():
    ws = _workers(3)
    policy = make_policy("round_robin", RouterConfig())
    picks = [policy.pick(_req(), ws) for _ in range(6)]
    assert [d.worker.url for d in picks] == [w.url for w in ws] * 2
    assert {d.reason for d in picks} == {"round_robin"}


def test_random_spreads():
    ws = _workers(2)
    policy = make_policy("random", RouterConfig())
    counts = collections.Counter(policy.pick(_req(), ws).worker.url for _ in range(200))
    assert len(counts) == 2 and min(counts.values()) > 50


def test_power_of_two_never_picks_the_busiest_of_two():
    ws = _workers(2)
    ws[0].outstanding_requests = 5
    policy = make_policy("power_of_two", RouterConfig())
    assert {policy.pick(_req(), ws).worker.url for _ in range(20)} == {ws[1].url}
    assert policy.pick(_req(), ws[:1]).worker is ws[0]  # one candidate: that one


def test_least_load_counts_outstanding_tokens():
    ws = _workers(3)
    ws[0].outstanding_tokens, ws[1].outstanding_tokens, ws[2].outstanding_tokens = 50, 10, 10
    ws[1].outstanding_requests = 2
    policy = make_policy("least_load", RouterConfig())
    decision = policy.pick(_req(), ws)
    assert decision.worker is ws[2] and decision.reason == "least_load"
