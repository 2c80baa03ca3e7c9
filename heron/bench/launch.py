"""Start `heron serve` on a free loopback port for `heron bench serve --launch`, and stop it."""

from __future__ import annotations

import shlex
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
    print(f"launching: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc, url = subprocess.Popen(cmd, stdout=sys.stderr), f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"heron serve exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"heron serve not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace: float = 30.0) -> int:
    """SIGTERM (heron drains in-flight requests), SIGKILL after ``grace`` s; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
