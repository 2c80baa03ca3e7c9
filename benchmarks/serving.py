"""Online serving benchmark: Poisson arrivals against an OpenAI-compatible /v1/completions.

Usage: python benchmarks/serving.py --launch [--server-args "..."] | --url http://127.0.0.1:8000
The core (make_prompts, arrival_times, stream_request, summarize, run_rate) is importable."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

WORDS = ("time year people way day man thing woman life child world school state family group "
         "country problem hand part place case week company system program question work number "
         "night point home water room mother area money story fact month lot right study").split()


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds, relative to its send time)."""
    status: int = 0                      # HTTP status; 0 = transport error / timeout
    error: str = ""
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)  # gaps between text chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    retry_after: float = math.nan       # seconds, from a 429's Retry-After

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def make_prompts(num: int, input_len: int, seed: int = 0) -> list[str]:
    """`num` prompts of `input_len` random common words (about one token each), fixed seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(num)]


def arrival_times(num: int, rate: float, seed: int = 0) -> list[float]:
    """Send offsets (s) of a Poisson process at `rate` req/s; rate=inf sends all at t=0."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    gaps = (rng.expovariate(rate) for _ in range(max(num - 1, 0)))
    return list(itertools.accumulate(gaps, initial=0.0))[:num]


async def stream_request(client: httpx.AsyncClient, url: str, prompt: str, output_len: int,
                         timeout: float, model: str | None = None) -> RequestResult:
    """POST one streaming completion (ignore_eos, greedy) and time its SSE chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res, start, times = RequestResult(), time.perf_counter(), []  # times: text chunk arrivals
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                res.status = resp.status_code
                if resp.status_code != 200:
                    res.retry_after = float(resp.headers.get("retry-after") or "nan")
                    text = (await resp.aread()).decode(errors="replace")
                    raise RuntimeError(f"HTTP {resp.status_code}: {text}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    msg, now = json.loads(data), time.perf_counter()
                    if usage := msg.get("usage"):
                        res.prompt_tokens = usage["prompt_tokens"]
                        res.output_tokens = usage["completion_tokens"]
                    if msg.get("choices") and msg["choices"][0].get("text"):
                        times.append(now)
                else:
                    res.error = "stream ended without [DONE]"
    except Exception as exc:  # timeout, HTTP error, reset, bad JSON: an error, not a crash
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    res.e2e = time.perf_counter() - start
    if times:
        res.ttft, res.itl = times[0] - start, [b - a for a, b in zip(times, times[1:])]
    res.output_tokens = res.output_tokens or len(times)
    return res


def percentiles(xs: list[float], name: str, scale: float = 1000.0) -> dict:
    """Mean / P50 / P90 / P99 of xs (linear interpolation), scaled (default: s -> ms)."""
    xs = sorted(x * scale for x in xs if not math.isnan(x))
    out = {f"{name}_mean": sum(xs) / len(xs) if xs else None}
    for p in (50, 90, 99):
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"{name}_p{p}"] = xs[lo] + (xs[hi] - xs[lo]) * (k - lo) if xs else None
    return out


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict:
    """Aggregate one rate's results: counts, throughputs, latency percentiles (ms)."""
    ok = [r for r in results if r.ok]
    n429 = sum(r.status == 429 for r in results)
    out_tok = sum(r.output_tokens for r in ok)
    retry = [r.retry_after for r in results if not math.isnan(r.retry_after)]
    errors = sorted({r.error[:80] for r in results if not r.ok and r.status != 429})
    summary = {
        "request_rate": "inf" if math.isinf(rate) else rate, "num_prompts": len(results),
        "completed": len(ok), "rejected_429": n429, "errors": len(results) - len(ok) - n429,
        "rate_429": n429 / max(len(results), 1), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tok / duration,
        "total_output_tokens": out_tok, "mean_prompt_tokens": (
            sum(r.prompt_tokens for r in ok) / len(ok) if ok else None),
        "retry_after_max_s": max(retry) if retry else None, "error_samples": errors[:3]}
    summary |= percentiles([r.ttft for r in ok], "ttft_ms")
    summary |= percentiles([(r.e2e - r.ttft) / (r.output_tokens - 1)
                            for r in ok if r.output_tokens > 1], "tpot_ms")
    summary |= percentiles([g for r in ok for g in r.itl], "itl_ms")
    summary |= percentiles([r.e2e for r in ok], "e2e_ms")
    return summary


async def run_rate(url: str, prompts: list[str], output_len: int, rate: float, *,
                   max_concurrency: int | None = None, timeout: float = 300.0,
                   seed: int = 0, model: str | None = None) -> dict:
    """Send every prompt once on a Poisson schedule at `rate`; return summarize(...)."""
    sem = asyncio.Semaphore(max_concurrency or len(prompts))
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        start = time.perf_counter()

        async def one(offset: float, prompt: str) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with sem:
                return await stream_request(client, url, prompt, output_len, timeout, model)

        offsets = arrival_times(len(prompts), rate, seed)
        results = await asyncio.gather(*(one(t, p) for t, p in zip(offsets, prompts)))
        return summarize(results, time.perf_counter() - start, rate)


def launch_server(server_args: str, startup_timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    """Start `heron serve` on a free loopback port; wait for /health == 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *shlex.split(server_args)]
    print(f"launching: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc, url = subprocess.Popen(cmd, stdout=sys.stderr), f"http://127.0.0.1:{port}"
    for _ in range(int(startup_timeout / 0.5)):
        if proc.poll() is not None:
            raise RuntimeError(f"heron serve exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"server not healthy after {startup_timeout}s")


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: heron drains in-flight requests, then exits
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def print_table(rows: list[dict]) -> None:
    """Counts/throughput per rate, then latency stats (ms) per rate and metric."""
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"{'rate':>6} {'ok':>4} {'429':>4} {'err':>4} {'429%':>6} {'req/s':>7} "
          f"{'out tok/s':>10} {'dur s':>7}")
    for r in rows:
        print(f"{r['request_rate']:>6} {r['completed']:>4} {r['rejected_429']:>4} {r['errors']:>4} "
              f"{100 * r['rate_429']:>6.1f} {r['request_throughput']:>7.2f} "
              f"{r['output_token_throughput']:>10.1f} {r['duration_s']:>7.1f}")
    print(f"\n{'rate':>6} {'metric (ms)':>11} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8}")
    for r in rows:
        for m in ("ttft", "tpot", "itl", "e2e"):
            vals = " ".join(f"{f(r[f'{m}_ms_{k}']):>8}" for k in ("mean", "p50", "p90", "p99"))
            print(f"{r['request_rate']:>6} {m:>11} {vals}")


async def main_async(args) -> list[dict]:
    """One untimed warmup request, then every rate in turn against args.url."""
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    rows, load = [], os.getloadavg()[0]
    await run_rate(args.url, prompts[:1], args.output_len, math.inf, timeout=args.timeout,
                   model=args.model)  # warmup, not reported
    for rate in [float(r) for r in args.request_rates.split(",")]:
        row = await run_rate(args.url, prompts, args.output_len, rate, seed=args.seed,
                             max_concurrency=args.max_concurrency, timeout=args.timeout,
                             model=args.model)
        keys = ("input_len", "output_len", "max_concurrency", "server_args")
        row |= {k: getattr(args, k) for k in keys} | {"loadavg_1m_at_start": load}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="running server, loopback only (e.g. http://127.0.0.1:8000)")
    src.add_argument("--launch", action="store_true", help="start `heron serve` on a free port")
    p.add_argument("--server-args", default="", help="extra `heron serve` args with --launch")
    p.add_argument("--model", default=None, help="model field to send (default: server's)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=128, help="tokens per request (EOS ignored)")
    p.add_argument("--request-rates", default="1,2,4,inf", help="req/s list; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request limit (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.url and urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        p.error("--url must point at a loopback address")
    proc, url = launch_server(args.server_args) if args.launch else (None, args.url)
    args.url = url.rstrip("/")
    try:
        rows = asyncio.run(main_async(args))
    finally:
        if proc is not None:
            stop_server(proc)
    print_table(rows)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"config": vars(args), "results": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
