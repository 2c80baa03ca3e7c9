"""Served rows for the side-by-side benchmarks (benchmarks/vs_vllm.py, vs_llamacpp.py): load
a running server with `heron bench serve` in a subprocess (the same seeded prompts for every
server) and reduce each rate's record to the figures the tables show."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from heron.bench.server_metrics import DEFAULT_PATTERN


@dataclass(frozen=True)
class Load:
    """One `heron bench serve` run: ``rates`` (req/s, "inf": all at once) each with
    ``num`` prompts of ``input_len`` / ``output_len`` tokens (N or MIN:MAX), at most
    ``max_concurrency`` in flight (None: unbounded)."""

    rates: list[str]
    num: int
    input_len: str
    output_len: str
    seed: int = 0
    max_concurrency: int | None = None


def loadgen_command(url: str, load: Load, out: Path, tokenizer: Path | None = None,
                    model: str | None = None) -> list[str]:
    """The `heron bench serve` command line for ``load`` against ``url``."""
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "bench", "serve", "--url", url,
           "--request-rates", ",".join(load.rates), "--num-prompts", str(load.num),
           "--input-len", load.input_len, "--output-len", load.output_len,
           "--seed", str(load.seed), "--metrics-pattern", DEFAULT_PATTERN + "|iteration_tokens",
           "--no-progress", "--json-out", str(out)]
    if model is not None:
        cmd += ["--model", model]
    if tokenizer is not None:
        cmd += ["--tokenizer", str(tokenizer)]
    if load.max_concurrency is not None:
        cmd += ["--max-concurrency", str(load.max_concurrency)]
    return cmd


def run_load(url: str, load: Load, out: Path, timeout: float, **kw) -> list[dict]:
    """Run the load generator; its per-rate result rows."""
    subprocess.run(loadgen_command(url, load, out, **kw), check=True, timeout=timeout,
                   stdout=sys.stderr)
    return json.loads(out.read_text())["results"]


def served_summary(r: dict) -> dict:
    """The figures of one rate of a `bench serve` record, plus the server's step count when
    its /metrics has vLLM's iteration counters."""
    metrics = r.get("server_metrics") or {}

    def delta(prefix: str) -> float | None:
        values = [v["delta"] for k, v in metrics.items()
                  if k.startswith(prefix) and v["delta"] is not None]
        return sum(values) if values else None

    return {"output_tok_s": r["output_token_throughput"],
            "tpot_p50_ms": r["tpot_ms"]["p50"], "tpot_p99_ms": r["tpot_ms"]["p99"],
            "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
            "itl_p50_ms": r["itl_ms"]["p50"],
            "completed": r["completed"], "num_requests": r["num_requests"],
            "errors": r["errors"] + r["rejected_429"], "duration_s": r["duration_s"],
            "input_tokens": r["total_input_tokens"], "output_tokens": r["total_output_tokens"],
            "steps": delta("vllm:iteration_tokens_total_count"),
            "step_tokens": delta("vllm:iteration_tokens_total_sum")}


SERVED_METRICS = [("output tok/s", "output_tok_s"), ("TPOT p50 ms", "tpot_p50_ms"),
                  ("TPOT p99 ms", "tpot_p99_ms"), ("TTFT p50 ms", "ttft_p50_ms"),
                  ("TTFT p99 ms", "ttft_p99_ms")]


def threads_flags(flags: list[str], threads: int) -> list[str]:
    """`heron serve` flags with ``--threads threads`` added unless they set it already
    (heron's own default on CPU leaves one core idle)."""
    if any(f == "--threads" or f.startswith("--threads=") for f in flags):
        return list(flags)
    return [*flags, "--threads", str(threads)]

