"""heron vs vLLM's CPU build, side by side in one run: the same model, workloads and seeds.

    .venv/bin/python benchmarks/vs_vllm.py                      # every row, full size
    .venv/bin/python benchmarks/vs_vllm.py --rows 1,4 --num-prompts 4 --input-len 16 \
        --output-len 16                                         # a smoke run (minutes)

Rows (greedy, EOS ignored, so both engines do the same work):
  1  offline, 1 x 128 in / 128 out           output tok/s
  2  offline, 64 x 128 / 128                 output tok/s
  3  offline, 64 x U[100,512] / U[100,256]   output tok/s (seeded random lengths)
  4  served, 32 x 128 / 128, Poisson 1 req/s output tok/s, TPOT and TTFT p50 / p99
  5  served, 32 x 128 / 128, all at once     output tok/s, TPOT and TTFT p50 / p99

vLLM runs both ways on every row: with its default thread binding (on n cores it computes on
n - 1 and reserves one for its scheduler) and with VLLM_CPU_OMP_THREADS_BIND=0-(n-1) (every
core). The ratio's denominator is the stronger of the two on that row (highest output tok/s),
named in the table. heron runs with ``--threads n`` (every core) unless ``--heron-args`` sets
``--threads``; each row records the threads of each engine.

Offline rows run heron's ``LLM.generate`` in this process, then (heron freed) vLLM's offline
``LLM`` in its venv (``heron.bench.vllm_peer``), once per binding, on the same token-id
prompts. Served rows start `heron serve`, then vLLM's OpenAI server once per binding, one at a
time, and load each with `heron bench serve` (streaming completions, the same seeded prompts).
vLLM gets heron's context, sequence and step-token budgets; ``--vllm-args`` adds or overrides
server flags. Figures go to ``--out`` (default benchmarks/results/vs_vllm.json) and a JSON
line on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from heron.bench import launch
from heron.bench.machine import machine_info
from heron.bench.peer_compare import RATIO_NOTE, compare, format_comparison
from heron.bench.peer_serve import (SERVED_METRICS, Load, run_load, served_summary,
                                    threads_flags)
from heron.bench.table import fmt
from heron.bench.workloads import Sample, random_workload


@dataclass(frozen=True)
class Row:
    kind: str  # "offline" | "served"
    num: int
    input_len: str
    output_len: str
    rate: str = ""  # served: request rate ("inf": all at once)

    @property
    def title(self) -> str:
        rate = f", {self.rate} req/s" if self.rate else ""
        return f"{self.kind} {self.num} x {self.input_len}/{self.output_len}{rate}"


ROWS = {1: Row("offline", 1, "128", "128"), 2: Row("offline", 64, "128", "128"),
        3: Row("offline", 64, "100:512", "100:256"), 4: Row("served", 32, "128", "128", "1"),
        5: Row("served", 32, "128", "128", "inf")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from heron.bench.vllm_peer import default_venv

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the "
                   "embedded SmolLM2-135M-Instruct, exported once as a float32 HF directory)")
    p.add_argument("--rows", default="1,2,3,4,5", help="comma-separated subset of 1-5")
    p.add_argument("--num-prompts", type=int, default=None, help="override rows 2-5's count")
    p.add_argument("--input-len", default=None, help="override every row's: N or MIN:MAX")
    p.add_argument("--output-len", default=None, help="override every row's: N or MIN:MAX")
    p.add_argument("--seed", type=int, default=0, help="workload seed (both engines)")
    p.add_argument("--max-model-len", type=int, default=1024, help="both engines' context")
    p.add_argument("--heron-args", default="", help="extra `heron serve` engine flags (used "
                   "offline too), e.g. '--max-num-seqs 64'; without --threads, heron runs on "
                   "every core")
    p.add_argument("--vllm-args", default="", help="extra vLLM OpenAI-server flags")
    p.add_argument("--vllm-venv", type=Path, default=default_venv(),
                   help="vLLM's venv (created on first use)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="per server (s)")
    p.add_argument("--run-timeout", type=float, default=3600.0,
                   help="per offline row per engine, and per load-generator run (s)")
    p.add_argument("--bindings", default="default,all", help="vLLM thread bindings to run: "
                   "default (VLLM_CPU_OMP_THREADS_BIND unset), all (every core), or both")
    p.add_argument("--out", default="benchmarks/results/vs_vllm.json",
                   help="JSON file of the figures")
    return p.parse_args(argv)


def selected_rows(args) -> dict[int, Row]:
    """The rows asked for, with the count and length overrides applied."""
    rows = {}
    for part in args.rows.split(","):
        if int(part) not in ROWS:
            raise SystemExit(f"--rows: no row {part} (rows are 1-5)")
        row = ROWS[int(part)]
        if args.num_prompts and row.num > 1:
            row = replace(row, num=args.num_prompts)
        rows[int(part)] = replace(row, input_len=args.input_len or row.input_len,
                                  output_len=args.output_len or row.output_len)
    return dict(sorted(rows.items()))


def heron_flags(args, model_dir: Path) -> list[str]:
    """`heron serve` flags: the model, the context, ``--heron-args``, and ``--threads`` = every
    core unless ``--heron-args`` sets it."""
    flags = ["--model", str(model_dir), "--max-model-len", str(args.max_model_len),
             *shlex.split(args.heron_args)]
    return threads_flags(flags, len(os.sched_getaffinity(0)))


def selected_bindings(args) -> list:
    """The vLLM bindings ``--bindings`` asks for (on one core only the default exists)."""
    from heron.bench.vllm_peer import bindings

    every = bindings()
    wanted = {w.strip() for w in args.bindings.split(",")}
    if not wanted <= {"default", "all"}:
        raise SystemExit(f"--bindings: give default, all or both, not {args.bindings!r}")
    picked = [b for b in every if ("default" if b.bind is None else "all") in wanted]
    return picked or every[:1]


def heron_namespace(args, model_dir: Path) -> argparse.Namespace:
    """``--heron-args`` parsed as `heron serve` parses them, so that offline and served heron
    are configured alike (and vLLM gets the same budgets)."""
    from heron.entrypoints.cli import build_parser

    return build_parser().parse_args(["serve", *heron_flags(args, model_dir)])


# ---- offline rows ------------------------------------------------------------------------
def _heron_offline_class():
    from heron.bench.heron_offline import HeronOffline

    class HeronEngine(HeronOffline):
        """heron's offline side built from `heron serve` flags; counts the timed call's steps."""

        def __init__(self, ns: argparse.Namespace) -> None:
            from heron.entrypoints.cli import _make_llm

            self.llm = _make_llm(ns)
            self.engine = self.llm.engine
            self.last_steps = None

        def _steps(self) -> int | None:
            scheduler = getattr(getattr(self.engine, "core", None), "scheduler", None)
            return scheduler.stats.num_steps if scheduler is not None else None

        def generate(self, samples):
            before = self._steps()
            result = super().generate(samples)
            after = self._steps()
            self.last_steps = after - before if before is not None else None
            return result

    return HeronEngine


def offline_work(row: Row, seed: int, vocab: int) -> tuple[list[Sample], list[Sample]]:
    """(timed token-id samples, a few short untimed warmup samples on other prompts)."""
    samples = random_workload(row.num, row.input_len, row.output_len, seed, vocab)
    warmup = random_workload(min(4, row.num), row.input_len, "8", seed + 1000, vocab)
    return samples, warmup


def run_offline(args, rows: dict[int, Row], ns, model_dir: Path, python: Path,
                binds: list) -> dict:
    """heron on every offline row, then (heron freed) vLLM on the same samples, once per
    binding."""
    from heron.bench.throughput import run_engine

    if not rows:
        return {}
    heron, results, ids = _heron_offline_class()(ns), {}, {}
    try:
        work = {i: offline_work(row, args.seed + i, heron.vocab_size) for i, row in rows.items()}
        for i, (samples, warmup) in work.items():
            heron.check_fits(samples)
            print(f"row {i}: heron, {rows[i].title}", file=sys.stderr, flush=True)
            record, ids[i] = run_engine(heron, samples, warmup)
            results[i] = {"heron": record | {"steps": heron.last_steps,
                                             "threads": f"{ns.threads} torch threads"},
                          "vllm": {}, "agreement": {}}
    finally:
        heron.close()
        del heron
        gc.collect()
    for binding in binds:
        offline_vllm(args, ns, model_dir, python, binding, work, rows, results, ids)
    return results


def offline_vllm(args, ns, model_dir, python, binding, work, rows, results, ids) -> None:
    """vLLM's offline LLM under ``binding`` on every offline row's samples."""
    from heron.bench.throughput import _agreement, run_engine
    from heron.bench.vllm_peer import VLLMPeer

    peer = VLLMPeer(model_dir, ns.dtype, ns.max_model_len, ns.max_num_seqs,
                    ns.max_num_batched_tokens, prefix_caching=ns.enable_prefix_caching,
                    python=python, timeout=args.run_timeout, binding=binding)
    try:
        for i, (samples, warmup) in work.items():
            print(f"row {i}: vLLM {binding.name}, {rows[i].title}", file=sys.stderr,
                  flush=True)
            record, vllm_ids = run_engine(peer, samples, warmup)
            results[i]["vllm"][binding.name] = record | {"threads": binding.threads}
            results[i]["agreement"][binding.name] = _agreement(ids[i], vllm_ids)
    finally:
        peer.close()


# ---- served rows -------------------------------------------------------------------------
def served_load(args, rows: list[Row]) -> Load:
    row = rows[0]  # served rows differ only in their rate
    return Load([r.rate for r in rows], row.num, row.input_len, row.output_len, args.seed)


def serve_heron(args, model_dir: Path, rows: list[Row], workdir: Path) -> list[dict]:
    proc, url = launch.start(shlex.join(heron_flags(args, model_dir)), args.startup_timeout)
    try:
        return run_load(url, served_load(args, rows), workdir / "serve_heron.json",
                        args.run_timeout, tokenizer=model_dir, model=str(model_dir))
    finally:
        launch.stop(proc)


def serve_vllm(args, ns, model_dir: Path, python: Path, rows: list[Row], workdir: Path,
               binding) -> list[dict]:
    """vLLM's OpenAI server under ``binding``, loaded like heron's."""
    from heron.bench.vllm_peer import server_command

    port, tag = launch.free_port(), binding.name.replace(" ", "_")
    log_path, url = workdir / f"vllm_server_{tag}.log", f"http://127.0.0.1:{port}"
    cmd = server_command(python, model_dir, ns.dtype, ns.max_model_len, ns.max_num_seqs,
                         ns.max_num_batched_tokens, ns.enable_prefix_caching, port,
                         shlex.split(args.vllm_args))
    print(f"vLLM ({binding.name}) server log: {log_path}", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        try:
            proc = launch.start_command(cmd, url, "vLLM server", args.startup_timeout,
                                        group=True, stdout=log, stderr=subprocess.STDOUT,
                                        env=binding.env())
        except (RuntimeError, TimeoutError):
            print(log_path.read_text()[-3000:], file=sys.stderr)
            raise
        try:
            return run_load(url, served_load(args, rows), workdir / f"serve_vllm_{tag}.json",
                            args.run_timeout, tokenizer=model_dir, model=str(model_dir))
        finally:
            launch.stop(proc, group=True)


def run_served(args, rows: dict[int, Row], ns, model_dir: Path, python: Path,
               workdir: Path, binds: list) -> dict:
    """heron's server, then vLLM's once per binding, each under the same load; summaries
    per row."""
    if not rows:
        return {}
    served = list(rows.values())
    heron = serve_heron(args, model_dir, served, workdir)
    results = {i: {"heron": served_summary(h) | {"threads": f"{ns.threads} torch threads"},
                   "vllm": {}} for i, h in zip(rows, heron)}
    for binding in binds:
        vllm = serve_vllm(args, ns, model_dir, python, served, workdir, binding)
        for i, v in zip(rows, vllm):
            results[i]["vllm"][binding.name] = served_summary(v) | {"threads": binding.threads}
    return results


# ---- report ------------------------------------------------------------------------------
METRICS = {"offline": [("output tok/s", "output_tok_s")], "served": SERVED_METRICS}


def add_ratios(rows: dict[int, Row], results: dict) -> None:
    """results[i]["stronger"] = the vLLM binding with the higher output tok/s on row i;
    results[i]["ratios"][key] = heron / that binding for every figure of the row."""
    for i, res in results.items():
        res |= compare(res["heron"], res["vllm"], [k for _, k in METRICS[rows[i].kind]])


def print_table(rows: dict[int, Row], results: dict, binds: list) -> None:
    print(RATIO_NOTE)
    for kind in ("offline", "served"):
        part = [(f"{i}  {rows[i].title}", res["heron"], res["vllm"], res)
                for i, res in results.items() if rows[i].kind == kind]
        if part:
            print(format_comparison(part, METRICS[kind], [b.name for b in binds], "vLLM"))


def limits_line(i: int, row: Row, res: dict) -> str:
    """What bounds the row's figures, from what is cheap to know."""
    h = res["heron"]
    if row.kind == "offline":
        steps = h.get("steps")
        heron = (f"heron {steps:,} steps, {steps / h['elapsed_s']:.1f} steps/s, "
                 f"{h['output_tokens'] / steps:.1f} out tok/step" if steps else "heron -")
        vllm = "; ".join(f"vLLM {b} {v['elapsed_s']:.1f} s, identical outputs "
                         f"{res['agreement'][b]['identical_frac']:.0%}"
                         for b, v in res["vllm"].items())
        return f"row {i}: {heron}; {vllm} (vLLM's worker reports no steps)"
    parts = [f"ITL p50 (~ one decode step) heron {fmt(h['itl_p50_ms'])} ms"]
    for b, v in res["vllm"].items():
        steps = (f" ({v['steps']:,.0f} steps, {v['step_tokens'] / v['steps']:.1f} tok/step)"
                 if v.get("steps") else "")
        same = "same" if h["input_tokens"] == v["input_tokens"] else "DIFFERENT"
        fails = f", FAILED requests {v['errors']}" if v["errors"] else ""
        parts.append(f"vLLM {b} {fmt(v['itl_p50_ms'])} ms{steps}, input tokens {same}{fails}")
    if h["errors"]:
        parts.append(f"FAILED heron requests {h['errors']}")
    return f"row {i}: " + "; ".join(parts)


def threads_line(ns, machine: dict, binds: list, workdir: Path) -> str:
    """Compute threads per engine: on a small or shared machine they bound every figure."""
    vllm = []
    for b in binds:
        log = workdir / f"vllm_server_{b.name.replace(' ', '_')}.log"
        cores = re.findall(r"core ids=(\[[^\]]*\])", log.read_text()) if log.exists() else []
        seen = f", its log: cores {cores[-1]}" if cores else ""
        vllm.append(f"{b.name} (VLLM_CPU_OMP_THREADS_BIND={b.bind or 'unset'}: "
                    f"{b.threads}{seen})")
    return (f"threads: heron {ns.threads} torch threads; vLLM {'; '.join(vllm)}; "
            f"{machine.get('cores')} cores, load {machine.get('loadavg_1m_at_start')} at start")


def main(argv: list[str] | None = None) -> int:
    from heron.bench.vllm_peer import VLLM_VERSION, ensure_venv, peer_model_dir

    args = parse_args(argv)
    rows, binds = selected_rows(args), selected_bindings(args)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tempfile.gettempdir()) / "vllm-cache"))
    machine = machine_info()  # before the run: the load average shows others' work
    model_dir = peer_model_dir(args.model)
    ns = heron_namespace(args, model_dir)
    python = ensure_venv(args.vllm_venv)
    workdir = Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    print(f"model {model_dir}; per-request records and logs in {workdir}", file=sys.stderr)
    offline = {i: r for i, r in rows.items() if r.kind == "offline"}
    served = {i: r for i, r in rows.items() if r.kind == "served"}
    results = run_offline(args, offline, ns, model_dir, python, binds)
    results |= run_served(args, served, ns, model_dir, python, workdir, binds)
    add_ratios(rows, results)
    print_table(rows, results, binds)
    notes = [limits_line(i, rows[i], res) for i, res in results.items()]
    notes.append(threads_line(ns, machine, binds, workdir))
    print("\n".join(notes))
    record = {"kind": "vs_vllm", "machine": machine, "vllm_version": VLLM_VERSION,
              "config": vars(args) | {"vllm_venv": str(args.vllm_venv),
                                      "model_dir": str(model_dir),
                                      "heron_flags": heron_flags(args, model_dir),
                                      "heron_threads": ns.threads,
                                      "vllm_bindings": [vars(b) for b in binds]},
              "workdir": str(workdir), "notes": notes,
              "rows": {i: {"title": rows[i].title, **res} for i, res in results.items()}}
    write_record(record, Path(args.out))
    return 0


def write_record(record: dict, out: Path) -> None:
    """The record to ``out`` (indented) and as one JSON line on stdout, headline figures
    only (per-row heron, each vLLM binding, the stronger one, the ratios)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    brief = {i: {"heron": r["heron"].get("output_tok_s"), "stronger": r["stronger"],
                 "vllm": {b: v.get("output_tok_s") for b, v in r["vllm"].items()},
                 "ratios": r["ratios"]} for i, r in record["rows"].items()}
    print(json.dumps({"kind": "vs_vllm", "heron_threads": record["config"]["heron_threads"],
                      "rows": brief}, separators=(",", ":")))
    print(f"figures: {out}")


if __name__ == "__main__":
    sys.exit(main())
