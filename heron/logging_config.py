"""heron's logging: one format, with levels, in every process (the CLI or library process,
the engine-core process, every worker rank), and startup progress.

``configure(level, process)`` gives the ``heron`` logger one stderr handler in
``FORMAT``. The level comes from the argument, else ``$HERON_LOGGING_LEVEL``, else INFO
(vLLM's default), and is written back to ``$HERON_LOGGING_LEVEL`` so that child processes
(spawned or started with ``subprocess``) inherit it: each child's entry calls ``configure``
with its own ``process`` tag, which prefixes its lines (``(core pid=123)``).

``HERON_CONFIGURE_LOGGING=0`` leaves the ``heron`` logger alone (the application's own
handlers then decide), like ``VLLM_CONFIGURE_LOGGING``.

Progress bars (tqdm) appear only on a terminal (stderr is a TTY) with INFO enabled: never on
stdout, never in a log file. ``startup_phase`` logs how long each startup phase took.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

from heron import envs

LEVEL_ENV = "HERON_LOGGING_LEVEL"  # read through heron.envs, written here for children
FORMAT = "%(heron_process)s%(asctime)s %(levelname)s %(name)s: %(message)s"
ROOT = "heron"

_handler: logging.Handler | None = None


class _ProcessTag(logging.Filter):
    """Adds ``heron_process``: empty in the main process, ``(core pid=N) `` in a child."""

    def __init__(self, process: str | None) -> None:
        super().__init__()
        self.tag = f"({process} pid={os.getpid()}) " if process else ""

    def filter(self, record: logging.LogRecord) -> bool:
        record.heron_process = self.tag
        return True


def _level_from(value: int | str | None) -> int:
    """A level number from a number or a name (``"debug"``, ``"WARNING"``); INFO for None."""
    if value is None or value == "":
        return logging.INFO
    if isinstance(value, int):
        return value
    if value.strip().lstrip("-").isdigit():
        return int(value)
    number = logging.getLevelName(value.strip().upper())
    if not isinstance(number, int):
        raise ValueError(f"unknown logging level {value!r} (debug, info, warning, error)")
    return number


def configure(level: int | str | None = None, process: str | None = None) -> int:
    """Set the ``heron`` logger's level and its one handler; returns the level. ``level``
    None: ``$HERON_LOGGING_LEVEL``, else INFO. Idempotent (a second call replaces the
    handler and the level)."""
    global _handler
    resolved = _level_from(level if level is not None else envs.HERON_LOGGING_LEVEL)
    os.environ[LEVEL_ENV] = logging.getLevelName(resolved)  # children inherit it
    logger = logging.getLogger(ROOT)
    logger.setLevel(resolved)
    if not envs.HERON_CONFIGURE_LOGGING:
        return resolved
    if _handler is not None:
        logger.removeHandler(_handler)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter(FORMAT))
    _handler.addFilter(_ProcessTag(process))
    logger.addHandler(_handler)
    logger.propagate = False  # one line per record, even under a root handler
    return resolved


def configure_default() -> None:
    """For library use (``LLM()``): configure once unless the application already gave the
    ``heron`` logger a handler (or ``HERON_CONFIGURE_LOGGING=0``)."""
    if _handler is None and not logging.getLogger(ROOT).handlers:
        configure()


def verbose() -> bool:
    """DEBUG enabled: errors then carry their traceback."""
    return logging.getLogger(ROOT).isEnabledFor(logging.DEBUG)


def progress_enabled() -> bool:
    """Whether to draw progress bars: on a terminal, with INFO enabled."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return tty and logging.getLogger(ROOT).isEnabledFor(logging.INFO)


def progress(iterable=None, **kwargs):
    """A tqdm bar on stderr (see ``progress_enabled``), otherwise the iterable as it is."""
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, disable=not progress_enabled(), leave=False,
                dynamic_ncols=True, **kwargs)


class _Phase:
    """What a ``startup_phase`` block may add to its line."""

    detail = ""


@contextlib.contextmanager
def startup_phase(logger: logging.Logger, name: str, detail: str = ""):
    """Log ``startup: <name> took X s (detail)`` at INFO when the block ends; the block may
    set ``.detail`` on what it gets."""
    phase = _Phase()
    phase.detail = detail
    started = time.monotonic()
    yield phase
    elapsed = time.monotonic() - started
    logger.info("startup: %s took %.1f s%s", name, elapsed,
                f" ({phase.detail})" if phase.detail else "")


@contextlib.contextmanager
def waiting(logger: logging.Logger, desc: str, note_after_s: float = 3.0):
    """For a blocking call with no progress of its own (a compiler run): after
    ``note_after_s`` one INFO line says it is still going, and on a terminal a bar counts
    the seconds until the block ends."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(note_after_s):
            return
        logger.info("%s (still going after %.0f s)...", desc, note_after_s)
        with progress(desc=desc, unit=" s", bar_format="{desc}: {elapsed}") as bar:
            while not done.wait(1.0):
                bar.update(1)

    watcher = threading.Thread(target=watch, daemon=True, name="heron-progress")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(2.0)
