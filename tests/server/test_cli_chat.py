"""`heron chat` through a pseudo-terminal, as a user types: Ctrl-C stops a reply and the chat
goes on, Ctrl-C at the prompt clears the line, the Up arrow recalls a line, /help, /reset,
/stats, Ctrl-D quits with status 0. And `heron generate` on a terminal: progress bars."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time

import pytest

CTRL_C, CTRL_D, UP = b"\x03", b"\x04", b"\x1b[A"
MAX_TOKENS = 3000  # far more than the time between the first token and Ctrl-C allows


class Terminal:
    """A child process on a pty; ``expect`` reads until a pattern shows (bounded in time)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes the program
            os.execve(argv[0], argv, env)
        # a terminal of 40 x 120 (a pty starts at 0 x 0, where progress bars draw nothing)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.seen = b""

    def expect(self, pattern: bytes, timeout: float = 180.0) -> re.Match:
        """The first match of ``pattern`` in what arrived since the last match."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (found := re.search(pattern, self.seen)) is not None:
                self.seen = self.seen[found.end():]
                return found
            ready, _, _ = select.select([self.fd], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                self.seen += chunk
        raise AssertionError(f"{pattern!r} not seen ({self.status()}); last output: "
                             f"{self.seen[-1500:]!r}")

    def status(self) -> str:
        """'running', or how the child ended (for failure messages)."""
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return "already reaped"
        return f"exited with {os.waitstatus_to_exitcode(status)}" if pid else "running"

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining, so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.seen += os.read(self.fd, 65536)
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"the chat did not exit; last output: {self.seen[-1500:]!r}")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


@pytest.fixture
def chat(served_model):
    env = {k: v for k, v in os.environ.items() if k != "HERON_LOGGING_LEVEL"}
    term = Terminal([sys.executable, "-m", "heron", "chat", "--model", served_model, "--quiet",
                     "--ignore-eos", "--max-tokens", str(MAX_TOKENS), "--max-model-len",
                     "4096"], {**env, "TERM": "xterm"})
    try:
        yield term
    finally:
        term.kill()


def _stopped_reply(term: Terminal, message: bytes) -> None:
    term.send(message + b"\r")
    term.expect(rb"assistant> \s*\S")  # the reply has started
    term.send(CTRL_C)
    term.expect(rb"\[reply stopped")
    term.expect(rb"you> ")


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(chat):
    chat.expect(rb"you> ", timeout=240)
    _stopped_reply(chat, b"Tell me a story")
    chat.send(b"/stats\r")
    found = chat.expect(rb"last reply: (\d+) tokens in [\d.]+ s \([\d.]+ tokens/s\), stopped")
    assert 0 < int(found[1]) < MAX_TOKENS
    chat.expect(rb"speculative decoding: off")
    _stopped_reply(chat, b"And another")  # the conversation goes on
    chat.send(b"/reset\r")
    chat.expect(rb"conversation reset \(2 exchanges forgotten\)")
    chat.expect(rb"you> ")
    chat.send(CTRL_D)
    assert chat.wait() == 0


def test_prompt_keys_and_commands(chat):
    chat.expect(rb"you> ", timeout=240)
    chat.send(b"half a line")
    chat.expect(rb"half a line")  # echoed: the line is in readline's buffer, not the tty's
    chat.send(CTRL_C)  # clears the line: nothing is sent
    chat.expect(rb"you> ")
    chat.send(b"/help\r")
    for command in (b"/help", b"/reset", b"/stats", b"/exit"):
        chat.expect(re.escape(command))
    chat.expect(rb"you> ")
    chat.send(b"/reset\r")
    chat.expect(rb"conversation reset \(0 exchanges forgotten\)")
    chat.send(UP + b"\r")  # readline recalls "/reset"
    chat.expect(rb"conversation reset \(0 exchanges forgotten\)")
    assert b"^[[A" not in chat.seen
    chat.expect(rb"you> ")
    chat.send(b"/exit\r")
    assert chat.wait() == 0


def test_generate_draws_progress_bars_on_a_terminal(served_model):
    env = {k: v for k, v in os.environ.items() if k != "HERON_LOGGING_LEVEL"}
    term = Terminal([sys.executable, "-m", "heron", "generate", "Hi", "--model", served_model,
                     "--max-tokens", "2"], env)
    try:
        term.expect(rb"INFO heron\.cli: heron generate: starting")
        term.expect(rb"loading weights: \d+ tensors")
        term.expect(rb"INFO heron\.worker\.worker: startup: weights took")
        assert term.wait() == 0
    finally:
        term.kill()
