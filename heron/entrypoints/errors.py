"""How a ``heron`` command reports a failure: one line saying what is wrong (the messages
raised for bad input already say what to do); the traceback only with ``-v``."""

from __future__ import annotations

from heron.errors import EngineStartupError

# the user's input is wrong (exit status 2, as argparse uses); anything else is status 1
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
               PermissionError)
_USER_ERROR_NAMES = {cls.__name__ for cls in USER_ERRORS}


def is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, EngineStartupError):
        return exc.kind in _USER_ERROR_NAMES
    return isinstance(exc, USER_ERRORS)


def describe_error(exc: BaseException) -> str:
    """One line: the message of a user error as it is; the class name too otherwise, with a
    pointer to ``-v``."""
    if isinstance(exc, EngineStartupError):
        if exc.kind in _USER_ERROR_NAMES:
            return _first_line(exc.reason)
        return _first_line(str(exc)) + " (run with -v for the engine core's traceback)"
    if is_user_error(exc) or isinstance(exc, (ImportError, RuntimeError)) and str(exc):
        return _first_line(str(exc))
    return f"{type(exc).__name__}: {_first_line(str(exc))} (run with -v for the traceback)"


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"
