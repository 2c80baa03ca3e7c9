"""Routing policies by name: ``make_policy(name, config)``."""

from __future__ import annotations

from heron.route.config import RouterConfig
from heron.route.policies.base import Decision, Policy, RouteRequest
from heron.route.policies.simple import (LeastLoadPolicy, PowerOfTwoPolicy, RandomPolicy,
                                         RoundRobinPolicy)

__all__ = ["Decision", "Policy", "RouteRequest", "make_policy", "SIMPLE_POLICIES"]

SIMPLE_POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (RoundRobinPolicy, RandomPolicy, PowerOfTwoPolicy, LeastLoadPolicy)}


def make_policy(name: str, config: RouterConfig) -> Policy:
    """The policy called ``name``; ``cache_aware`` loads its module only when asked for."""
    if name in SIMPLE_POLICIES:
        return SIMPLE_POLICIES[name]()
    if name == "cache_aware":
        try:
            from heron.route.policies.cache_aware import CacheAwarePolicy
        except ImportError as exc:
            if exc.name != "heron.route.policies.cache_aware":
                raise
            raise ValueError("the cache_aware policy is not available in this build "
                             "(heron/route/policies/cache_aware.py is missing)") from exc
        return CacheAwarePolicy.from_config(config)
    known = ", ".join([*SIMPLE_POLICIES, "cache_aware"])
    raise ValueError(f"unknown policy {name!r}; choose from {known}")
