"""Errors shared across layers (the engine core, executors, workers, the engine client)."""

from __future__ import annotations


class EngineFault(RuntimeError):
    """A failure no single request explains (every request of a step failed alone, steps keep
    failing entirely, or a worker is gone): the engine cannot go on serving."""


class EngineStartupError(RuntimeError):
    """The engine core (a process of its own) failed to start. ``reason`` is its exception
    as one line (``FileNotFoundError: model 'x' not found: ...``), ``kind`` that exception's
    class name (empty when the process died or timed out without saying why)."""

    def __init__(self, reason: str, kind: str = "") -> None:
        super().__init__(f"the engine core failed to start: {reason}")
        self.reason, self.kind = reason, kind

    @classmethod
    def from_detail(cls, detail: str) -> EngineStartupError:
        """From ``traceback.format_exception_only``'s line: ``Name: message``."""
        name, sep, message = detail.partition(": ")
        if sep and name.replace(".", "").replace("_", "").isalnum() and " " not in name:
            return cls(message, name.rsplit(".", 1)[-1])
        return cls(detail)


# ---- the engine client's errors (the API process raises them per request) ------------------
class EngineDeadError(RuntimeError):
    """The engine-core process is gone (crashed, killed, frozen or shut down)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request while processing it (finish_reason "error"); the
    engine itself goes on serving the others."""


class RequestAbortedError(RuntimeError):
    """The server ended this request before it finished (``abort_all``: shutting down and its
    grace period ran out); the engine was told to abort it and frees its KV blocks."""
