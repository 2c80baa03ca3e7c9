"""Served decode speed by torch thread choice, on the machine as it is and with a busy process.

For each configuration (heron's default, ``--threads 1``, the old default: torch's choice, one
thread per core, and the default with the engine core pinned to the last cores and the API
server to the first), start ``heron serve`` with the embedded SmolLM2, time its first line of
output and its readiness (/health 200), then stream a few greedy completions (one at a time)
twice: on the machine as it is, and with a second process spinning a Python busy loop
(``while True: pass``, not pinned: the kernel places it). Each figure comes with the load
average measured when it started: this machine is shared, "as is" is not quiet.

Prints a table and one JSON line; ``--out`` writes the table as Markdown.

    .venv/bin/python benchmarks/threads.py --out benchmarks/results/threads.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from heron.bench.launch import free_port, stop

BUSY_LOOP = "while True: pass"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def start_server(extra: list[str], timeout: float) -> tuple[subprocess.Popen, str, dict]:
    """``heron serve`` on a free port; (process, URL, startup times in s)."""
    port = free_port()
    cmd = [sys.executable, "-m", "heron", "serve", "--port", str(port), *extra]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_line: list[float] = []

    def drain() -> None:  # keep the pipe empty; note when the first line came
        for _ in proc.stdout:
            if not first_line:
                first_line.append(time.monotonic() - started)

    threading.Thread(target=drain, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = started + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"heron serve {extra} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                ready = time.monotonic() - started
                return proc, url, {"first_line_s": first_line[0] if first_line else None,
                                   "ready_s": ready}
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise TimeoutError("server not ready")


def stream_gaps(url: str, max_tokens: int) -> list[float]:
    """Seconds between consecutive text chunks of one greedy streamed completion."""
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                if json.loads(line[5:])["choices"][0]["text"]:
                    times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def measure(url: str, requests: int, max_tokens: int) -> dict:
    load = os.getloadavg()[0]
    stream_gaps(url, 4)  # warm-up
    gaps: list[float] = []
    for _ in range(requests):
        gaps += stream_gaps(url, max_tokens)
    return {"load1": round(load, 2), "tokens": len(gaps),
            "tpot_p50_ms": round(1e3 * statistics.median(gaps), 1),
            "tpot_p99_ms": round(1e3 * percentile(gaps, 0.99), 1),
            "tpot_mean_ms": round(1e3 * statistics.fmean(gaps), 1)}


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def pin(server_pid: int, cores: list[int]) -> str:
    """The engine core's threads on every core but the first; the API server on the first."""
    core_pid = next(c for c in children(server_pid)
                    if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes())
    engine_cores, api_cores = set(cores[1:]) or set(cores), {cores[0]}
    for pid, where in ((core_pid, engine_cores), (server_pid, api_cores)):
        for tid in Path(f"/proc/{pid}/task").iterdir():
            os.sched_setaffinity(int(tid.name), where)
    return f"engine core on {sorted(engine_cores)}, API server on {sorted(api_cores)}"


def run_config(name: str, extra: list[str], pinned: bool, args) -> dict:
    proc, url, startup = start_server(extra, args.startup_timeout)
    row = {"config": name, "flags": " ".join(extra) or "(none)", **startup}
    try:
        if pinned:
            row["pinning"] = pin(proc.pid, sorted(os.sched_getaffinity(0)))
        row["as_is"] = measure(url, args.requests, args.max_tokens)
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        try:
            time.sleep(1.0)
            row["busy"] = measure(url, args.requests, args.max_tokens)
        finally:
            busy.kill()
            busy.wait()
    finally:
        stop(proc)
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def table(rows: list[dict], cores: int) -> str:
    lines = ["| configuration | flags | first line (s) | ready (s) | as is: load1 | TPOT P50 / P99 "
             "(ms) | + busy loop: load1 | TPOT P50 / P99 (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["as_is"], r["busy"]
        lines.append(f"| {r['config']} | `{r['flags']}` | {r['first_line_s']:.1f} | "
                     f"{r['ready_s']:.1f} | {a['load1']} | {a['tpot_p50_ms']} / "
                     f"{a['tpot_p99_ms']} | {b['load1']} | {b['tpot_p50_ms']} / "
                     f"{b['tpot_p99_ms']} |")
    return "\n".join(lines) + f"\n\n({cores} cores available to the run.)\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3, help="streamed completions per figure")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="write the table (Markdown) here")
    p.add_argument("--startup-only", action="store_true",
                   help="only time `heron serve` (defaults) to its first line and to ready")
    args = p.parse_args()
    if args.startup_only:
        proc, _, startup = start_server([], args.startup_timeout)
        stop(proc)
        print(json.dumps({"load1": round(os.getloadavg()[0], 2), **startup}))
        return 0
    cores = len(os.sched_getaffinity(0))
    import torch

    old = torch.get_num_threads()  # torch's own choice: what heron used before
    configs = [("default", [], False), ("--threads 1", ["--threads", "1"], False),
               (f"old default (torch's choice: {old})", ["--threads", str(old)], False),
               ("default, pinned", [], True)]
    rows = [run_config(name, extra, pinned, args) for name, extra, pinned in configs]
    text = table(rows, cores)
    print(text)
    print(json.dumps({"cores": cores, "rows": rows}))
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
