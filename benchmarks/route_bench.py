"""`heron route` vs SGLang's gateway (sglang-router) in front of the same heron workers, in one run.

    .venv/bin/python benchmarks/route_bench.py            # SmolLM2 workers, ~10 min on 2 cores
    .venv/bin/python benchmarks/route_bench.py --quick    # a tiny random model, ~2 min (smoke)
    .venv/bin/python benchmarks/route_bench.py --targets direct,heron_ca,sglang_ca --parts tenants

Two `heron serve` workers (``heron.route.launch.WorkerGroup``: one core each, pinned, their
torch threads set to match, KV events published) serve the embedded SmolLM2-135M-Instruct with
a small KV cache (``--kv-blocks``: room for about 5 of the 8 tenants' system prompts, so where
a prefix lands matters). In front of them, one at a time, the targets:

  direct      no router: the load generator itself alternates between the workers
  heron_rr    heron route --policy round_robin
  heron_ca    heron route --policy cache_aware (precise: the workers' KV events)
  sglang_rr   sglang-router --policy round_robin   (.venv/peers/sglang-router)
  sglang_ca   sglang-router --policy cache_aware   (its approximate text tree)

Both routers run with their default resilience settings. Parts (``--parts``):

  latency     added latency: tiny requests (max_tokens 1, one word) one at a time, every
              target up at once and the requests interleaved between them round by round (a
              noisy shared machine drifts alike for all); P50 / P99 minus direct's.
  throughput  saturation: ``--concurrency`` clients in a closed loop, short prompts, a few
              output tokens, requests/s and the ratio to direct.
  (rounds)    throughput and tenants run ``--rounds`` times over the targets, every other
              round in reverse order, pooled: the machine's drift (other work on it) then
              hits every target alike. Sequential parts stay noisier than the interleaved
              latency part; the hit rate is nearly deterministic.
  tenants     multi-tenant chat: ``--tenants`` system prompts x ``--users`` users in a shuffled
              order, streamed, ``--tenant-concurrency`` clients; the workers' prefix caches are
              reset first and their ``heron:prefix_cache_{hits,queries}_total`` scraped before
              and after (token hit rate), with requests per worker and TTFT P50 / P99.
  kill        a worker is SIGKILLed (with its engine) once ``--kill-after`` of the streamed
              requests have finished: completed, failed with an explicit error (HTTP status or
              an error event in the stream) and lost (a stream cut without an error, no
              response); the worker is restarted afterwards (not for direct).

The cores: each worker is pinned to its own core; the routers and the load generator (this
process) are not pinned and share both cores with the workers (there is no third core). Load
averages before each part are recorded. Results: benchmarks/results/route_bench.{json,md} and
route_bench.png; a table and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from heron.bench import http_client
from heron.bench.http_client import Endpoint, send
from heron.bench.machine import machine_info, machine_summary
from heron.bench.server_metrics import parse
from heron.bench.table import fmt, format_table
from heron.bench.workloads import WORDS, Sample
from heron.route.launch import WorkerGroup, free_ports

RESULTS = Path("benchmarks/results")
SGLANG_VENV = Path(".venv/peers/sglang-router")
TARGETS = ("direct", "heron_rr", "heron_ca", "sglang_rr", "sglang_ca")
PARTS = ("latency", "throughput", "tenants", "kill")
MODEL = "smollm2"
WORKER_METRICS = r"request_success"
ROUTER_METRICS = r"decision|predict|prefix|hit|retr|breaker|circuit"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- routers ------------------------------------------------------------------------------
@dataclass
class Router:
    """One router process in front of the workers (``proc`` None: direct access)."""

    name: str
    url: str | None = None
    proc: subprocess.Popen | None = None
    log_path: str | None = None
    metrics_url: str | None = None


def router_command(name: str, port: int, worker_urls: list[str], metrics_port: int,
                   sglang_venv: Path) -> list[str]:
    kind, short = name.split("_")
    policy = {"rr": "round_robin", "ca": "cache_aware"}[short]
    if kind == "heron":
        return [sys.executable, "-m", "heron.entrypoints.cli", "route", "--host", "127.0.0.1",
                "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
                "--log-level", "warning", "--shutdown-timeout-secs", "2"]
    return [str(sglang_venv / "bin" / "python"), "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port",
            str(metrics_port), "--log-level", "warn", "--shutdown-grace-period-secs", "2"]


def _router_ready(router: Router, worker_urls: list[str]) -> bool:
    """The router answers a tiny completion and lists both workers (where it lists them)."""
    try:
        listing = httpx.get(f"{router.url}/workers", timeout=2)
        if listing.status_code == 200 and not all(u.split("//")[1] in listing.text
                                                  for u in worker_urls):
            return False
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
        return httpx.post(f"{router.url}/v1/completions", json=body,
                          timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def start_router(name: str, worker_urls: list[str], args) -> Router:
    if name == "direct":
        return Router(name)
    port, metrics_port = free_ports(2)
    cmd = router_command(name, port, worker_urls, metrics_port, args.sglang_venv)
    log_path = str(args.log_dir / f"{name}.log")
    with open(log_path, "a") as f:  # one log per router across the rounds
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    metrics = f"http://127.0.0.1:{metrics_port}" if name.startswith("sglang") else url
    router = Router(name, url, proc, log_path, metrics)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if _router_ready(router, worker_urls):
            return router
        time.sleep(0.3)
    stop_router(router)
    tail = Path(log_path).read_text(errors="replace")[-1500:]
    raise RuntimeError(f"{name} did not get ready ({shlex.join(cmd)}):\n{tail}")


def stop_router(router: Router) -> None:
    proc = router.proc
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


# ---- load generation ----------------------------------------------------------------------
_apply_usage = http_client._apply_usage


def _apply_usage_and_cached(record, msg: dict) -> None:
    """``send`` reads prompt and completion tokens from a response's usage; this keeps its
    ``prompt_tokens_details.cached_tokens`` too (the worker's prefix-cache hit for that
    request), as ``record.cached_tokens``."""
    _apply_usage(record, msg)
    details = (msg.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        record.cached_tokens = details["cached_tokens"]


http_client._apply_usage = _apply_usage_and_cached  # a hook on the benchmark client


@dataclass(frozen=True)
class MessagesEndpoint(Endpoint):
    """An Endpoint whose chat samples carry their whole message list (system + user)."""

    def body(self, sample: Sample) -> dict:
        if self.kind == "chat" and isinstance(sample.prompt, list):
            return super().body(Sample("", sample.output_len)) | {"messages": sample.prompt}
        return super().body(sample)


def endpoints(router: Router, worker_urls: list[str], kind: str = "completions",
              stream: bool = False) -> list[Endpoint]:
    """Where the requests go: the router, or (direct) the workers in turn."""
    urls = worker_urls if router.url is None else [router.url]
    return [MessagesEndpoint.from_url(u, kind=kind, model=MODEL, stream=stream) for u in urls]


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=256,
                                                 max_keepalive_connections=256),
                             timeout=httpx.Timeout(120, connect=5))


async def closed_loop(http, eps: list[Endpoint], samples: list[Sample], concurrency: int,
                      timeout: float, counts: dict | None = None) -> tuple[list, float]:
    """``concurrency`` clients send ``samples`` in order (sample i to ``eps[i % len]``);
    (records, wall seconds). ``counts`` ("sent", "done") is kept up to date."""
    counts = counts if counts is not None else {}
    counts.update(sent=0, done=0)
    records: list = [None] * len(samples)
    todo = iter(enumerate(samples))
    start = time.perf_counter()

    async def one_client() -> None:
        for i, sample in todo:
            counts["sent"] += 1
            sent = time.perf_counter() - start
            records[i] = await send(http, eps[i % len(eps)], sample, timeout)
            records[i].send = sent
            counts["done"] += 1

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def ms(values) -> list[float]:
    return [v * 1000 for v in values if v is not None]


def rounded(values: list[float]) -> list[float]:
    return [round(v, 2) for v in values]


def dist(name: str, values: list[float]) -> dict:
    """P50 / P99 / mean of ``values`` (ms) as ``{name}_p50_ms`` ..."""
    return {f"{name}_p50_ms": pct(values, 50), f"{name}_p99_ms": pct(values, 99),
            f"{name}_mean_ms": float(np.mean(values)) if values else None}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---- parts --------------------------------------------------------------------------------
async def part_latency(routers: list[Router], worker_urls: list[str], args) -> dict:
    """Sequential tiny requests, interleaved between the targets round by round."""
    sample = Sample("Hi", 1)
    eps = {r.name: endpoints(r, worker_urls) for r in routers}
    lat: dict[str, list[float]] = {r.name: [] for r in routers}
    order = [r.name for r in routers]
    async with client() as http:
        for rnd in range(args.latency_warmup + args.latency_requests):
            random.Random(rnd).shuffle(order)
            for name in order:
                rec = await send(http, eps[name][rnd % len(eps[name])], sample, 30)
                if rnd >= args.latency_warmup:
                    lat[name].append(rec.e2e * 1000 if rec.ok else float("nan"))
    out = {}
    base = [x for x in lat.get("direct", []) if x == x]
    for name, xs in lat.items():
        ok = [x for x in xs if x == x]
        row = {"n": len(xs), "errors": len(xs) - len(ok), "p50_ms": pct(ok, 50),
               "p99_ms": pct(ok, 99), "mean_ms": float(np.mean(ok)) if ok else None}
        if base and ok:
            row["added_p50_ms"] = row["p50_ms"] - pct(base, 50)
            row["added_p99_ms"] = row["p99_ms"] - pct(base, 99)
        out[name] = row
    return out


async def part_throughput(router: Router, worker_urls: list[str], args) -> dict:
    rng = random.Random(1)
    samples = [Sample(words(rng, 16), args.throughput_tokens)
               for _ in range(args.throughput_requests)]
    async with client() as http:
        await closed_loop(http, endpoints(router, worker_urls), samples[:8], 8, 60)  # warm
        before = await per_worker_requests(http, worker_urls)
        records, wall = await closed_loop(http, endpoints(router, worker_urls), samples,
                                          args.concurrency, 120)
        per_worker = await per_worker_requests(http, worker_urls, before)
    ok = [r for r in records if r.ok]
    return {"requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
            "requests_per_worker": per_worker, "wall_s": wall, "req_s": len(ok) / wall,
            "out_tokens": sum(r.output_tokens for r in ok),
            "out_tok_s": sum(r.output_tokens for r in ok) / wall,
            **dist("e2e", ms(r.e2e for r in ok)), "raw": {"e2e_ms": rounded(ms(r.e2e for r in ok))},
            "error_samples": sorted({r.error for r in records if not r.ok})[:3]}


def tenant_samples(args) -> list[Sample]:
    rng = random.Random(7)
    systems = [f"You are assistant number {t}. " + words(rng, args.system_words)
               for t in range(args.tenants)]
    pairs = [(t, u) for t in range(args.tenants) for u in range(args.users)]
    rng.shuffle(pairs)
    return [Sample([{"role": "system", "content": systems[t]},
                    {"role": "user", "content": f"User {u}: " + words(rng, rng.randint(12, 24))}],
                   args.tenant_tokens) for t, u in pairs]


async def _scrape(http, url: str, pattern: str) -> dict:
    try:
        resp = await http.get(f"{url}/metrics", timeout=10)
        return parse(resp.text, pattern) if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def _delta(before: dict, after: dict, key: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0] == key)


async def per_worker_requests(http, worker_urls: list[str], before: list | None = None):
    """The workers' finished-request counters now, or (given ``before``) since then."""
    now = [await _scrape(http, u, WORKER_METRICS) for u in worker_urls]
    if before is None:
        return now
    return [int(_delta(b, a, "heron:request_success_total")) for b, a in zip(before, now)]


async def part_tenants(router: Router, worker_urls: list[str], args) -> dict:
    """Hit rate = the cached prompt tokens the workers report in each response's usage
    (``prompt_tokens_details.cached_tokens``) / its prompt tokens, summed over requests."""
    samples = tenant_samples(args)
    async with client() as http:
        for u in worker_urls:
            (await http.post(f"{u}/reset_prefix_cache", timeout=30)).raise_for_status()
        before = await per_worker_requests(http, worker_urls)
        records, wall = await closed_loop(http, endpoints(router, worker_urls, "chat", True),
                                          samples, args.tenant_concurrency, 300)
        per_worker = await per_worker_requests(http, worker_urls, before)
        routed = await _scrape(http, router.metrics_url, ROUTER_METRICS) \
            if router.metrics_url else {}
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(getattr(r, "cached_tokens", 0) for r in ok)
    return {"requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
            "wall_s": wall, "hit_rate": cached / prompt if prompt else None,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "requests_with_usage": sum(hasattr(r, "cached_tokens") for r in ok),
            "requests_per_worker": per_worker, **dist("ttft", ms(r.ttft for r in ok)),
            **dist("e2e", ms(r.e2e for r in ok)),
            "raw": {"ttft_ms": rounded(ms(r.ttft for r in ok)),
                    "e2e_ms": rounded(ms(r.e2e for r in ok))},
            "router_metrics": routed,
            "error_samples": sorted({r.error for r in records if not r.ok})[:3]}


def classify(rec) -> str:
    """completed / error_http (refused with a status) / error_event (the stream said so) /
    lost_truncated (a stream cut without an error) / lost_no_response (reset, timeout)."""
    if rec.ok:
        return "completed"
    if rec.status not in (0, 200):
        return "error_http"
    if "error in stream" in rec.error:
        return "error_event"
    return "lost_truncated" if rec.status == 200 else "lost_no_response"


async def part_kill(router: Router, group: WorkerGroup, args) -> dict:
    rng = random.Random(3)
    samples = [Sample(words(rng, 24), args.kill_tokens) for _ in range(args.kill_requests)]
    counts: dict = {}
    async with client() as http:
        task = asyncio.create_task(closed_loop(http, endpoints(router, group.urls,
                                                               stream=True),
                                               samples, args.kill_concurrency, 90, counts))
        deadline = time.monotonic() + 120
        while (counts.get("done", 0) < args.kill_after * len(samples) and not task.done()
               and time.monotonic() < deadline):
            await asyncio.sleep(0.02)
        at_kill = dict(counts)
        await asyncio.to_thread(group.kill, 1)
        killed = time.perf_counter()
        records, wall = await task
    kinds = [classify(r) for r in records]
    out = {k: kinds.count(k) for k in ("completed", "error_http", "error_event",
                                       "lost_truncated", "lost_no_response")}
    started = [k for k, r in zip(kinds, records) if r.chunks and k != "completed"]
    return out | {"requests": len(records), "in_flight_at_kill": at_kill["sent"] -
                  at_kill["done"], "done_at_kill": at_kill["done"],
                  "failed_after_first_chunk": len(started),
                  "wall_after_kill_s": time.perf_counter() - killed, "wall_s": wall,
                  "statuses": sorted({r.status for r in records if not r.ok}),
                  "error_samples": sorted({r.error for r in records if not r.ok})[:4]}


# ---- orchestration ------------------------------------------------------------------------
async def warm(worker_urls: list[str], n: int = 12) -> None:
    """Untimed requests to each worker (short and long prompts): first-request costs (lazy
    allocations, kernel choices) stay out of the measurements."""
    rng = random.Random(99)
    samples = [Sample(words(rng, 16 if i % 3 else 150), 8) for i in range(n * len(worker_urls))]
    eps = [Endpoint.from_url(u, model=MODEL, stream=False) for u in worker_urls]
    async with client() as http:
        await closed_loop(http, eps, samples, 4 * len(worker_urls), 120)


def worker_args(args) -> list[str]:
    model = [str(args.model)] if args.model else []
    return model + ["--max-model-len", "1024", "--num-kv-blocks", str(args.kv_blocks),
                    "--served-model-name", MODEL, "--disable-log-stats",
                    "--no-enable-log-requests"]


def run_parts(group: WorkerGroup, args, record: dict) -> None:
    urls = group.urls
    if "latency" in args.parts:
        record["load"]["latency"] = round(os.getloadavg()[0], 2)
        routers = []
        try:
            routers = [start_router(name, urls, args) for name in args.targets]
            record["latency"] = asyncio.run(part_latency(routers, urls, args))
        finally:
            for r in routers:
                stop_router(r)
        p50 = {k: round(v.get("p50_ms") or 0, 2) for k, v in record["latency"].items()}
        log(f"latency P50 ms: {json.dumps(p50)}")
    rows: dict[str, dict[str, list[dict]]] = {}
    try:
        for rnd in range(args.rounds):  # odd rounds in reverse order: drift hits all alike
            order = args.targets if rnd % 2 == 0 else args.targets[::-1]
            kills = [n for n in order if n != "direct" and "kill" in args.parts
                     and rnd == args.rounds - 1]  # the kill part once, in the last round
            for pos, name in enumerate(order):
                parts = [p for p in ("throughput", "tenants") if p in args.parts]
                parts += ["kill"] if name in kills else []
                if parts:
                    run_target(name, parts, rnd, group, args, record, rows)
                if name in kills and pos < len(order) - 1:  # the last needs no restart
                    t0 = time.perf_counter()
                    group.restart(1, startup_timeout_s=300)
                    asyncio.run(warm(urls[1:]))
                    log(f"worker 1 restarted in {time.perf_counter() - t0:.0f} s")
    finally:  # what was measured, even when a later part fails
        for part, by_name in rows.items():
            record[part] = {name: merge(part, runs) for name, runs in by_name.items()}


def run_target(name: str, parts: list[str], rnd: int, group: WorkerGroup, args, record: dict,
               rows: dict) -> None:
    """One router up, its parts run, the router stopped; each part's row kept in ``rows``."""
    router = start_router(name, group.urls, args)
    try:
        for part in parts:
            key = f"{part}/{name}" + (f"/{rnd + 1}" if args.rounds > 1 else "")
            record["load"][key] = round(os.getloadavg()[0], 2)
            t0 = time.perf_counter()
            coro = (part_kill(router, group, args) if part == "kill" else
                    globals()[f"part_{part}"](router, group.urls, args))
            row = asyncio.run(coro)
            rows.setdefault(part, {}).setdefault(name, []).append(row)
            log(f"{key} in {time.perf_counter() - t0:.0f} s: {json.dumps(_brief(row))}")
    finally:
        stop_router(router)


SUMMED = ("requests", "completed", "errors", "wall_s", "out_tokens", "prompt_tokens",
          "cached_tokens", "requests_with_usage")


def merge(part: str, runs: list[dict]) -> dict:
    """One row from a target's rounds: counts summed, rates over the summed time, latency
    percentiles over the pooled requests; each round's own row under "rounds"."""
    if len(runs) == 1:
        return runs[0]
    out = {k: sum(r[k] for r in runs) for k in SUMMED if k in runs[0]}
    out["requests_per_worker"] = [sum(x) for x in zip(*(r["requests_per_worker"]
                                                         for r in runs))]
    raw = {k: [x for r in runs for x in r["raw"][k]] for k in runs[0]["raw"]}
    for key, values in raw.items():
        out.update(dist(key.removesuffix("_ms"), values))
    if part == "throughput":
        out["req_s"] = out["completed"] / out["wall_s"]
        out["out_tok_s"] = out["out_tokens"] / out["wall_s"]
    if part == "tenants":
        out["hit_rate"] = out["cached_tokens"] / out["prompt_tokens"] \
            if out["prompt_tokens"] else None
        out["router_metrics"] = runs[-1].get("router_metrics")
    out["error_samples"] = sorted({e for r in runs for e in r.get("error_samples", [])})[:4]
    out["rounds"] = [_brief(r) for r in runs]
    out["raw"] = raw
    return out


def _brief(row: dict) -> dict:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
            if k not in ("router_metrics", "error_samples", "raw", "rounds")}


def tiny_model(path: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from server_fixture import make_tiny_served_model

    return make_tiny_served_model(path)


def cpu_split(group: WorkerGroup) -> dict:
    return {"workers": {w.url: list(w.cpus) for w in group.workers},
            "worker_threads": [w.threads for w in group.workers],
            "routers_and_load_generator": sorted(os.sched_getaffinity(0)),
            "note": "each worker (API server + engine) pinned to its own core; the router "
                    "and the load generator unpinned, sharing both cores with the workers"}


# ---- report -------------------------------------------------------------------------------
def table(record: dict) -> tuple[list[str], list[list]]:
    head = ["target", "added P50 ms", "added P99 ms", "sat. req/s", "vs direct",
            "hit rate", "TTFT P50 ms", "TTFT P99 ms", "req/worker", "kill: ok/err/lost"]
    base = (record.get("throughput") or {}).get("direct", {}).get("req_s")
    rows = []
    for name in record["config"]["targets"]:
        lat = (record.get("latency") or {}).get(name, {})
        thr = (record.get("throughput") or {}).get(name, {})
        ten = (record.get("tenants") or {}).get(name, {})
        kill = (record.get("kill") or {}).get(name)
        hit = ten.get("hit_rate")
        kill_cell = "-" if not kill else (
            f"{kill['completed']}/{kill['error_http'] + kill['error_event']}/"
            f"{kill['lost_truncated'] + kill['lost_no_response']}")
        rows.append([name, lat.get("added_p50_ms"), lat.get("added_p99_ms"), thr.get("req_s"),
                     f"{thr['req_s'] / base:.2f}x" if base and thr.get("req_s") else "-",
                     f"{hit:.1%}" if hit is not None else "-", ten.get("ttft_p50_ms"),
                     ten.get("ttft_p99_ms"),
                     "/".join(map(str, ten.get("requests_per_worker") or [])) or "-",
                     kill_cell])
    return head, rows


def markdown(record: dict) -> str:
    cfg, head_rows = record["config"], table(record)
    lines = [f"# heron route vs sglang-router ({machine_summary(record['machine'])})", "",
             f"Run: `{record['command']}`, {record['wall_s'] / 60:.1f} min; model: "
             f"{record['model']}; sglang-router {record.get('sglang_router_version', '?')}. "
             f"Load average (1 min) before each part: "
             + ", ".join(f"{k} {v}" for k, v in record["load"].items()), "",
             f"Cores: {record['cpu_split']['note']} (workers: "
             + ", ".join(f"{u} -> {c}" for u, c in record["cpu_split"]["workers"].items())
             + ").", "",
             _drift(record), "",
             "| " + " | ".join(head_rows[0]) + " |", "|" + "---|" * len(head_rows[0])]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in head_rows[1]]
    lines += ["", f"* added latency: {cfg['latency_requests']} sequential requests per target "
              "(max_tokens 1), interleaved; P50/P99 of the target minus direct's "
              "(direct's own: " + _direct_latency(record) + ").",
              f"* rounds: {cfg['rounds']} over the targets for the saturation and tenant parts "
              "(every other one in reverse order; requests pooled), the kill part in the last.",
              f"* saturation: {cfg['throughput_requests']} requests, {cfg['concurrency']} "
              f"clients, 16-word prompts, {cfg['throughput_tokens']} output tokens.",
              f"* tenants: {cfg['tenants']} system prompts of ~{cfg['system_words']} words x "
              f"{cfg['users']} users (chat, streamed, {cfg['tenant_concurrency']} clients, "
              f"{cfg['tenant_tokens']} output tokens), worker KV cache {cfg['kv_blocks']} blocks "
              "of 16 tokens each, reset before each run; hit rate = the cached prompt tokens the "
              "workers report in each response's usage (`prompt_tokens_details.cached_tokens`) "
              "/ prompt tokens.",
              f"* kill: {cfg['kill_requests']} streamed requests ({cfg['kill_tokens']} tokens, "
              f"{cfg['kill_concurrency']} clients), worker 1 SIGKILLed after "
              f"{cfg['kill_after']:.0%} finished; err = an HTTP error status or an error event "
              "in the stream, lost = a stream cut without an error or no response.", ""]
    for part in ("kill", "tenants", "throughput"):
        for name, row in (record.get(part) or {}).items():
            if row.get("error_samples"):
                lines.append(f"* {part}/{name} errors: " + "; ".join(
                    f"`{e[:160]}`" for e in row["error_samples"]))
    for key, err in (record.get("errors") or {}).items():
        lines += ["", f"**{key} failed**: `{err}`"]
    return "\n".join(lines) + "\n"


def _drift(record: dict) -> str:
    loads = list(record["load"].values())
    return (f"The machine's load average went from {loads[0]} to {loads[-1]} during the run "
            "(other work on it): the saturation and TTFT columns, measured one target after "
            "another, carry that drift (the rounds in alternating order spread it); the added "
            "latency (interleaved requests) and the hit rate (nearly deterministic) do not."
            ) if loads else ""


def _direct_latency(record: dict) -> str:
    d = (record.get("latency") or {}).get("direct") or {}
    return f"P50 {fmt(d.get('p50_ms'))} ms, P99 {fmt(d.get('p99_ms'))} ms" if d else "-"


def plot(record: dict, path: Path) -> str | None:
    from heron.bench.plots import DPI, _pyplot

    names = record["config"]["targets"]
    panels = [("latency", "added latency (ms): P50, P99", ("added_p50_ms", "added_p99_ms")),
              ("tenants", "TTFT (ms): P50, P99", ("ttft_p50_ms", "ttft_p99_ms")),
              ("tenants", "prefix-cache hit rate", ("hit_rate",))]
    panels = [p for p in panels if record.get(p[0])]
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (part, title, keys) in zip(axes[0], panels):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            vals = [(record[part].get(n) or {}).get(key) for n in names]
            ax.bar([i + j * width for i in range(len(names))],
                   [np.nan if v is None else v for v in vals], width, color=f"C{j}",
                   label=key.split("_")[-2] if len(keys) > 1 else None)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(names))], names,
                      rotation=30, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return str(path)


def summary(record: dict) -> dict:
    out = {"kind": "route_bench", "wall_s": round(record["wall_s"], 1), "model": record["model"]}
    for part, keys in (("latency", ("added_p50_ms", "added_p99_ms")),
                       ("throughput", ("req_s",)),
                       ("tenants", ("hit_rate", "ttft_p50_ms", "ttft_p99_ms")),
                       ("kill", ("completed", "error_http", "error_event", "lost_truncated",
                                 "lost_no_response"))):
        for name, row in (record.get(part) or {}).items():
            out.setdefault(name, {}).update(
                {k: round(row[k], 4) if isinstance(row.get(k), float) else row.get(k)
                 for k in keys if k in row})
    return out


# ---- main ---------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a tiny random model and small counts: a smoke run")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--rounds", type=int, default=None,
                   help="throughput and tenants parts: rounds over the targets, every other "
                        "one in reverse order (pooled); the kill part runs in the last "
                        "(default: 2; --quick: 1)")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--model", default=None,
                   help="the workers' model (default: the embedded SmolLM2; --quick: tiny)")
    p.add_argument("--kv-blocks", type=int, default=64, help="KV blocks per worker")
    p.add_argument("--latency-requests", type=int, default=100)
    p.add_argument("--latency-warmup", type=int, default=5)
    p.add_argument("--throughput-requests", type=int, default=64)
    p.add_argument("--throughput-tokens", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--system-words", type=int, default=160)
    p.add_argument("--tenant-tokens", type=int, default=4)
    p.add_argument("--tenant-concurrency", type=int, default=4)
    p.add_argument("--kill-requests", type=int, default=24)
    p.add_argument("--kill-tokens", type=int, default=32)
    p.add_argument("--kill-concurrency", type=int, default=8)
    p.add_argument("--kill-after", type=float, default=0.3,
                   help="share of the kill part's requests finished before the kill")
    p.add_argument("--sglang-venv", type=Path, default=SGLANG_VENV)
    p.add_argument("--log-dir", type=Path, default=None,
                   help="worker and router logs (default: a temporary directory)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="only rebuild the table, markdown and plot from a results file")
    args = p.parse_args(argv)
    if args.quick:
        args.latency_requests, args.throughput_requests = 40, 48
        args.users, args.kill_requests = 4, 16
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.targets = [t for t in args.targets.split(",") if t]
    args.parts = [x for x in args.parts.split(",") if x]
    for bad in set(args.targets) - set(TARGETS):
        p.error(f"unknown target {bad!r}")
    for bad in set(args.parts) - set(PARTS):
        p.error(f"unknown part {bad!r}")
    if any(t.startswith("sglang") for t in args.targets) and not args.render and \
            not (args.sglang_venv / "bin" / "python").exists():
        p.error(f"no sglang-router venv at {args.sglang_venv}: python3 -m venv "
                f"{args.sglang_venv} && {args.sglang_venv}/bin/pip install sglang-router")
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="route-bench-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


def sglang_version(venv: Path) -> str | None:
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.metadata "
                              "as m; print(m.version('sglang-router'))"], capture_output=True,
                             text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def report(record: dict, out_dir: Path) -> None:
    """The plot, the markdown file, the table and the JSON line of ``record``."""
    with contextlib.suppress(Exception):  # a plot is a nicety
        record["plot"] = plot(record, out_dir / "route_bench.png")
    (out_dir / "route_bench.md").write_text(markdown(record))
    print(f"\nheron route vs sglang-router ({record['model']})")
    print(format_table(*table(record)))
    print(json.dumps(summary(record), separators=(",", ":")))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        report(json.loads(args.render.read_text()), args.out_dir)
        return 0
    record = {"kind": "route_bench", "machine": machine_info(),
              "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "sglang_router_version": sglang_version(args.sglang_venv), "load": {}}
    start = time.perf_counter()
    if args.quick and not args.model:
        args.model = tiny_model(args.log_dir / "tiny-model")
    record["model"] = str(args.model or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)")
    group = WorkerGroup(2, worker_args(args), log_dir=args.log_dir / "workers")
    try:
        group.start(startup_timeout_s=300)
        record["worker_startup_s"] = round(time.perf_counter() - start, 1)
        record["cpu_split"] = cpu_split(group)
        log(f"workers up in {record['worker_startup_s']} s: {group.urls} (logs {args.log_dir})")
        asyncio.run(warm(group.urls))
        run_parts(group, args, record)
    except Exception as e:  # noqa: BLE001 - keep what was measured
        log(f"FAILED: {type(e).__name__}: {e}")
        record["errors"] = {"run": f"{type(e).__name__}: {e}"[:1000]}
    finally:
        group.stop()
    record.setdefault("cpu_split", cpu_split(group))
    record["wall_s"] = time.perf_counter() - start
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "route_bench.json").write_text(json.dumps(record, indent=1) + "\n")
    report(record, args.out_dir)
    return 1 if record.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
