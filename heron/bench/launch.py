"""Start `heron serve` on a free loopback port for `heron bench serve --launch` (or any server
command, with ``start_command``), and stop it."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server_args: str, timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    """Launch the server (its output goes to our stderr); return it and its URL once
    /health answers 200. Raises if it exits or is not healthy within ``timeout`` s."""
    port = free_port()
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *shlex.split(server_args)]
    url = f"http://127.0.0.1:{port}"
    return start_command(cmd, url, "heron serve", timeout), url


def start_command(cmd: list[str], url: str, name: str, timeout: float = 600.0,
                  group: bool = False, **popen_kw) -> subprocess.Popen:
    """Run any server command (output to our stderr unless ``stdout`` is given; in a process
    group of its own with ``group``, for ``stop(..., group=True)``) and return it once
    ``url``/health answers 200. Raises if it exits or is not healthy within ``timeout`` s."""
    print(f"launching: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    popen_kw.setdefault("stdout", sys.stderr)
    proc = subprocess.Popen(cmd, start_new_session=group, **popen_kw)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{name} not healthy after {timeout:.0f} s")
    except BaseException:  # not healthy, or interrupted: never leave the server running
        stop(proc, group=group)
        raise


def stop(proc: subprocess.Popen, grace: float = 30.0, group: bool = False) -> int:
    """SIGTERM (heron drains in-flight requests), SIGKILL after ``grace`` s; the exit code.
    With ``group`` (a process started by ``start_command(..., group=True)``) the signals go
    to its whole process group, and whatever of the group outlives it is killed."""
    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    if proc.poll() is None:
        send(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait(10)
    if group:
        send(signal.SIGKILL)  # what of the group outlived its leader (vLLM's engine core)
    return proc.returncode
