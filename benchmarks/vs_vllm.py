"""heron vs vLLM's CPU build, side by side in one run: the same model, workloads and seeds.

    .venv/bin/python benchmarks/vs_vllm.py                      # every row, full size
    .venv/bin/python benchmarks/vs_vllm.py --rows 1,4 --num-prompts 4 --input-len 16 \
        --output-len 16                                         # a smoke run (minutes)

Rows (greedy, EOS ignored, so both engines do the same work):
  1  offline, 1 x 128 in / 128 out           output tok/s
  2  offline, 64 x 128 / 128                 output tok/s
  3  offline, 64 x U[100,512] / U[100,256]   output tok/s (seeded random lengths)
  4  served, 32 x 128 / 128, Poisson 1 req/s output tok/s, TPOT p50, TTFT p50
  5  served, 32 x 128 / 128, all at once     output tok/s, TPOT p50, TTFT p50

Offline rows run heron's ``LLM.generate`` in this process, then (heron freed) vLLM's offline
``LLM`` in its venv (``heron.bench.vllm_peer``), on the same token-id prompts. Served rows
start `heron serve`, then vLLM's OpenAI server, one at a time, and load each with
`heron bench serve` (streaming completions, the same seeded prompts). vLLM gets heron's
context, sequence and step-token budgets; ``--vllm-args`` adds or overrides server flags.
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
from heron.bench.server_metrics import DEFAULT_PATTERN
from heron.bench.table import fmt, format_table
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
                   "offline too), e.g. '--max-num-seqs 64 --threads 2'")
    p.add_argument("--vllm-args", default="", help="extra vLLM OpenAI-server flags")
    p.add_argument("--vllm-venv", type=Path, default=default_venv(),
                   help="vLLM's venv (created on first use)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="per server (s)")
    p.add_argument("--run-timeout", type=float, default=3600.0,
                   help="per offline row per engine, and per load-generator run (s)")
    p.add_argument("--out", default="vs_vllm.json", help="JSON file of the figures")
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
    return ["--model", str(model_dir), "--max-model-len", str(args.max_model_len),
            *shlex.split(args.heron_args)]


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


def run_offline(args, rows: dict[int, Row], ns, model_dir: Path, python: Path) -> dict:
    """heron on every offline row, then (heron freed) vLLM on the same samples."""
    from heron.bench.throughput import _agreement, run_engine
    from heron.bench.vllm_peer import VLLMPeer

    if not rows:
        return {}
    heron, results, ids = _heron_offline_class()(ns), {}, {}
    try:
        work = {i: offline_work(row, args.seed + i, heron.vocab_size) for i, row in rows.items()}
        for i, (samples, warmup) in work.items():
            heron.check_fits(samples)
            print(f"row {i}: heron, {rows[i].title}", file=sys.stderr, flush=True)
            record, ids[i] = run_engine(heron, samples, warmup)
            results[i] = {"heron": record | {"steps": heron.last_steps}}
    finally:
        heron.close()
        del heron
        gc.collect()
    peer = VLLMPeer(model_dir, ns.dtype, ns.max_model_len, ns.max_num_seqs,
                    ns.max_num_batched_tokens, prefix_caching=ns.enable_prefix_caching,
                    python=python, timeout=args.run_timeout)
    try:
        for i, (samples, warmup) in work.items():
            print(f"row {i}: vLLM, {rows[i].title}", file=sys.stderr, flush=True)
            results[i]["vllm"], vllm_ids = run_engine(peer, samples, warmup)
            results[i]["agreement"] = _agreement(ids[i], vllm_ids)
    finally:
        peer.close()
    return results


# ---- served rows -------------------------------------------------------------------------
def loadgen(args, url: str, model_dir: Path, rows: list[Row], out: Path) -> list[dict]:
    """`heron bench serve` against ``url``, one rate per row (the same seeds for every
    server); its per-rate result rows."""
    row = rows[0]  # served rows differ only in their rate
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "bench", "serve", "--url", url,
           "--model", str(model_dir), "--tokenizer", str(model_dir),
           "--request-rates", ",".join(r.rate for r in rows), "--num-prompts", str(row.num),
           "--input-len", row.input_len, "--output-len", row.output_len,
           "--seed", str(args.seed), "--metrics-pattern", DEFAULT_PATTERN + "|iteration_tokens",
           "--no-progress", "--json-out", str(out)]
    subprocess.run(cmd, check=True, timeout=args.run_timeout, stdout=sys.stderr)
    return json.loads(out.read_text())["results"]


def serve_heron(args, model_dir: Path, rows: list[Row], workdir: Path) -> list[dict]:
    proc, url = launch.start(shlex.join(heron_flags(args, model_dir)), args.startup_timeout)
    try:
        return loadgen(args, url, model_dir, rows, workdir / "serve_heron.json")
    finally:
        launch.stop(proc)


def vllm_server_cmd(args, ns, model_dir: Path, python: Path, port: int) -> list[str]:
    """vLLM's OpenAI server with heron's context, sequence and step-token budgets."""
    prefix = [] if ns.enable_prefix_caching else ["--no-enable-prefix-caching"]
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--dtype", ns.dtype, "--max-model-len", str(ns.max_model_len),
            "--max-num-seqs", str(ns.max_num_seqs),
            "--max-num-batched-tokens", str(ns.max_num_batched_tokens),
            "--gpu-memory-utilization", "0.4", "--seed", "0", *prefix,
            "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.vllm_args)]


def serve_vllm(args, ns, model_dir: Path, python: Path, rows: list[Row], workdir: Path
               ) -> list[dict]:
    port, log_path = launch.free_port(), workdir / "vllm_server.log"
    cmd, url = vllm_server_cmd(args, ns, model_dir, python, port), f"http://127.0.0.1:{port}"
    print(f"vLLM server log: {log_path}", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        try:
            proc = launch.start_command(cmd, url, "vLLM server", args.startup_timeout,
                                        group=True, stdout=log, stderr=subprocess.STDOUT)
        except (RuntimeError, TimeoutError):
            print(log_path.read_text()[-3000:], file=sys.stderr)
            raise
        try:
            return loadgen(args, url, model_dir, rows, workdir / "serve_vllm.json")
        finally:
            launch.stop(proc, group=True)


def served_summary(r: dict) -> dict:
    """The figures of one rate of a `bench serve` record, plus vLLM's step count."""
    metrics = r.get("server_metrics") or {}

    def delta(prefix: str) -> float | None:
        values = [v["delta"] for k, v in metrics.items()
                  if k.startswith(prefix) and v["delta"] is not None]
        return sum(values) if values else None

    return {"output_tok_s": r["output_token_throughput"], "tpot_p50_ms": r["tpot_ms"]["p50"],
            "ttft_p50_ms": r["ttft_ms"]["p50"], "itl_p50_ms": r["itl_ms"]["p50"],
            "completed": r["completed"], "num_requests": r["num_requests"],
            "errors": r["errors"] + r["rejected_429"], "duration_s": r["duration_s"],
            "input_tokens": r["total_input_tokens"], "output_tokens": r["total_output_tokens"],
            "steps": delta("vllm:iteration_tokens_total_count"),
            "step_tokens": delta("vllm:iteration_tokens_total_sum")}


def run_served(args, rows: dict[int, Row], ns, model_dir: Path, python: Path,
               workdir: Path) -> dict:
    """heron's server, then vLLM's, each under the same load; summaries per row."""
    if not rows:
        return {}
    served = list(rows.values())
    heron = serve_heron(args, model_dir, served, workdir)
    vllm = serve_vllm(args, ns, model_dir, python, served, workdir)
    return {i: {"heron": served_summary(h), "vllm": served_summary(v)}
            for i, h, v in zip(rows, heron, vllm)}


# ---- report ------------------------------------------------------------------------------
METRICS = {"offline": [("output tok/s", "output_tok_s")],
           "served": [("output tok/s", "output_tok_s"), ("TPOT p50 ms", "tpot_p50_ms"),
                      ("TTFT p50 ms", "ttft_p50_ms")]}


def add_ratios(rows: dict[int, Row], results: dict) -> None:
    """results[i]["ratios"][key] = heron / vLLM for every figure of the row."""
    for i, res in results.items():
        res["ratios"] = {key: _ratio(res["heron"].get(key), res["vllm"].get(key))
                         for _, key in METRICS[rows[i].kind]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_table(rows: dict[int, Row], results: dict) -> None:
    print("ratio = heron / vLLM: tok/s higher is better (> 1: heron faster); "
          "ms lower is better (< 1: heron faster)")
    table = []
    for i, res in results.items():
        for n, (label, key) in enumerate(METRICS[rows[i].kind]):
            ratio = res["ratios"][key]
            table.append([f"{i}  {rows[i].title}" if n == 0 else "", label,
                          res["heron"].get(key), res["vllm"].get(key),
                          f"{ratio:.2f}x" if ratio is not None else "-"])
    print(format_table(["row", "metric", "heron", "vLLM", "heron/vLLM"], table))


def limits_line(i: int, row: Row, res: dict) -> str:
    """What bounds the row's figures, from what is cheap to know."""
    h, v = res["heron"], res["vllm"]
    if row.kind == "offline":
        steps = h.get("steps")
        heron = (f"heron {steps:,} steps, {steps / h['elapsed_s']:.1f} steps/s, "
                 f"{h['output_tokens'] / steps:.1f} out tok/step" if steps else "heron -")
        return (f"row {i}: {heron}; vLLM {v['elapsed_s']:.1f} s (its worker reports no "
                f"steps); identical outputs {res['agreement']['identical_frac']:.0%}")
    vllm_steps = (f", /metrics: {v['steps']:,.0f} steps, {v['step_tokens'] / v['steps']:.1f} "
                  f"tok/step" if v.get("steps") else "")
    same = "same" if h["input_tokens"] == v["input_tokens"] else "DIFFERENT"
    fails = "" if h["errors"] + v["errors"] == 0 else \
        f"; FAILED requests heron {h['errors']}, vLLM {v['errors']}"
    return (f"row {i}: ITL p50 (~ one decode step) heron {fmt(h['itl_p50_ms'])} ms, "
            f"vLLM {fmt(v['itl_p50_ms'])} ms{vllm_steps}; input tokens {same} "
            f"({h['input_tokens']:,} / {v['input_tokens']:,}){fails}")


def threads_line(ns, machine: dict, workdir: Path) -> str:
    """Compute threads per engine: on a small or shared machine they bound every figure."""
    heron = ns.threads or machine.get("torch_threads")
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    log = workdir / "vllm_server.log"
    cores = re.findall(r"core ids=(\[[^\]]*\])", log.read_text()) if log.exists() else []
    vllm = f"cores {cores[-1]}" if cores else "all cores but one, reserved for its scheduler" \
        if bind == "auto" else bind
    return (f"threads: heron {heron} torch threads (--heron-args '--threads N'); vLLM "
            f"{vllm} (VLLM_CPU_OMP_THREADS_BIND={bind}); {machine.get('cores')} cores, "
            f"load {machine.get('loadavg_1m_at_start')} at start")


def main(argv: list[str] | None = None) -> int:
    from heron.bench.vllm_peer import VLLM_VERSION, ensure_venv, peer_model_dir

    args = parse_args(argv)
    rows = selected_rows(args)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tempfile.gettempdir()) / "vllm-cache"))
    machine = machine_info()  # before the run: the load average shows others' work
    model_dir = peer_model_dir(args.model)
    ns = heron_namespace(args, model_dir)
    python = ensure_venv(args.vllm_venv)
    workdir = Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    print(f"model {model_dir}; per-request records and logs in {workdir}", file=sys.stderr)
    offline = {i: r for i, r in rows.items() if r.kind == "offline"}
    served = {i: r for i, r in rows.items() if r.kind == "served"}
    results = run_offline(args, offline, ns, model_dir, python)
    results |= run_served(args, served, ns, model_dir, python, workdir)
    add_ratios(rows, results)
    print_table(rows, results)
    notes = [limits_line(i, rows[i], res) for i, res in results.items()]
    notes.append(threads_line(ns, machine, workdir))
    print("\n".join(notes))
    record = {"kind": "vs_vllm", "machine": machine, "vllm_version": VLLM_VERSION,
              "config": vars(args) | {"vllm_venv": str(args.vllm_venv),
                                      "model_dir": str(model_dir),
                                      "heron_flags": heron_flags(args, model_dir)},
              "workdir": str(workdir), "notes": notes,
              "rows": {i: {"title": rows[i].title, **res} for i, res in results.items()}}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"figures: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
