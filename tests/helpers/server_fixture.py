"""Start `heron serve` as a subprocess on 127.0.0.1 and stop it (bounded waits everywhere)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_served_model(path: Path) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template: a server
    on it starts in seconds and generates in milliseconds, text prompts and chat included."""
    from hf_reference import make_tiny_model
    from heron.loader.gguf_loader import find_default_gguf, prepare_gguf_tokenizer_dir

    tokenizer_dir = prepare_gguf_tokenizer_dir(find_default_gguf())
    # a 4096-token context: servers and chats on it take --max-model-len up to that
    make_tiny_model("llama", path, vocab_size=49152, bos_token_id=1, eos_token_id=2,
                    max_position_embeddings=4096)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, path / f.name)
    return path


def wait_until_answering(url: str, proc: subprocess.Popen, timeout_s: float,
                         interval_s: float = 0.2) -> bool:
    """True once GET ``url`` answers 200; False when ``proc`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM (a server drains), SIGKILL after ``timeout``; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


class HeronServer:
    def __init__(self, *args: str, startup_timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        cmd = [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--port", str(self.port),
               "--max-model-len", "1024", *args]
        # the log goes to a file: a pipe nobody reads fills up (64 KiB of per-request log
        # lines) and then blocks the server's writes, and with them its event loop
        self.log = tempfile.NamedTemporaryFile("w+", prefix="heron-serve-", suffix=".log")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})})
        if wait_until_answering(f"{self.url}/health", self.proc, startup_timeout, 0.5):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited: {self.log_tail()}")
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log.name) as f:
            return f.read()[-chars:]

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", headers=self.headers, timeout=5).json()

    def wait_for(self, predicate, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        stats = self.stats()
        while not predicate(stats) and time.monotonic() < deadline:
            time.sleep(0.2)
            stats = self.stats()
        return stats

    def stop(self, timeout: float = 30.0) -> int:
        return stop_process(self.proc, timeout)
