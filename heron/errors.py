"""Errors shared across layers (the engine core, executors, workers)."""

from __future__ import annotations


class EngineFault(RuntimeError):
    """A failure no single request explains (every request of a step failed alone, steps keep
    failing entirely, or a worker is gone): the engine cannot go on serving."""
