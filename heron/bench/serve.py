"""`heron bench serve`: an asyncio load generator for an OpenAI-compatible server.

For each request rate in the sweep, fresh prompts of the same workload (a new seed per rate,
so a prefix cache cannot reuse an earlier rate's prompts) are sent on an arrival schedule
(Poisson, constant or gamma), at most ``--max-concurrency`` in flight (a request's clock
starts when it is really sent), each bounded by ``--timeout``; so every run ends. 429s are
counted, not retried. Per rate: latency distributions, throughput, goodput under the SLO,
errors, uptime, and (if the server has one) the change in its /metrics.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from urllib.parse import urlparse

from heron.bench import server_metrics
from heron.bench.arrivals import parse_rates, send_times
from heron.bench.http_client import Endpoint, send
from heron.bench.machine import machine_info
from heron.bench.metrics import SLO, RequestRecord, summarize
from heron.bench.results import emit
from heron.bench.table import format_table
from heron.bench.workloads import Sample, build_workload


async def run_rate(client, endpoint: Endpoint, samples: list[Sample], rate: float, *,
                   process: str = "poisson", burstiness: float = 1.0,
                   max_concurrency: int | None = None, timeout: float = 300.0, seed: int = 0,
                   progress: bool = False) -> tuple[list[RequestRecord], float]:
    """Send every sample once on the schedule; (records in sample order, duration s from the
    first scheduled send to the last response)."""
    from tqdm import tqdm

    offsets = send_times(len(samples), rate, process, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency or len(samples))
    bar = tqdm(total=len(samples), desc=f"rate {_rate_name(rate)}", unit="req",
               disable=not progress, file=sys.stderr, leave=False)
    start = time.perf_counter()

    async def one(offset: float, sample: Sample) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with gate:
            sent = time.perf_counter() - start
            record = await send(client, endpoint, sample, timeout)
        record.send = sent
        bar.update(1)
        return record

    try:
        records = await asyncio.gather(*(one(t, s) for t, s in zip(offsets, samples)))
    finally:
        bar.close()
    return records, time.perf_counter() - start


def _rate_name(rate: float) -> str | float:
    return "inf" if math.isinf(rate) else rate


async def _identify(client, endpoint: Endpoint) -> dict:
    """The served models and their owner (heron says 'heron'), if /v1/models answers."""
    try:
        resp = await client.get(endpoint.api_base + "/models", headers=endpoint.headers,
                                timeout=10)
        data = resp.json().get("data") or []
        return {"models": [m.get("id") for m in data],
                "owned_by": data[0].get("owned_by") if data else None}
    except Exception:  # noqa: BLE001 - identification is best effort
        return {"models": [], "owned_by": None}


async def sweep(endpoint: Endpoint, warmup: list[Sample], per_rate: list[list[Sample]],
                rates: list[float], args, slo: SLO) -> tuple[dict, list[dict]]:
    """Send the warmup samples (untimed), then run every rate in turn with its own samples;
    (server identity, one result row per rate)."""
    import httpx

    limits = httpx.Limits(max_connections=(args.max_concurrency or len(per_rate[0])) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        server = await _identify(client, endpoint)
        for sample in warmup:  # a failure here is worth knowing before the timed runs
            warm = await send(client, endpoint, Sample(sample.prompt, min(sample.output_len, 16)),
                              args.timeout)
            if not warm.ok:
                print(f"warning: warmup request failed: {warm.error}", file=sys.stderr)
        rows = []
        for i, (rate, samples) in enumerate(zip(rates, per_rate)):
            before = await _scrape(client, endpoint, args)
            records, duration = await run_rate(
                client, endpoint, samples, rate, process=args.arrival,
                burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                timeout=args.timeout, seed=args.seed + i, progress=not args.no_progress)
            after = await _scrape(client, endpoint, args)
            row = {"request_rate": _rate_name(rate)} | summarize(records, duration, slo)
            row["server_metrics"] = server_metrics.diff(before, after)
            row["requests"] = [r.to_json() for r in records]
            print(_row_line(row), file=sys.stderr, flush=True)
            rows.append(row)
    return server, rows


async def _scrape(client, endpoint: Endpoint, args) -> dict | None:
    if args.no_scrape_metrics:
        return None
    return await server_metrics.scrape(client, endpoint.root, endpoint.headers,
                                       args.metrics_pattern)


def _row_line(row: dict) -> str:
    return (f"rate {row['request_rate']}: {row['completed']}/{row['num_requests']} ok, "
            f"{row['rejected_429']} x 429, {row['errors']} errors, "
            f"{row['output_token_throughput']:.1f} out tok/s, goodput "
            f"{row['goodput']:.2f} req/s")


def _endpoint(args, url: str) -> Endpoint:
    return Endpoint.from_url(url, kind=args.endpoint, model=args.model, api_key=args.api_key,
                             stream=not args.no_stream, ignore_eos=not args.no_ignore_eos)


def _samples(args, num_rates: int) -> tuple[list[Sample], list[list[Sample]]]:
    """(warmup samples, one list of samples per rate, each from its own seed)."""
    count = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        count = lambda text: len(tok(text).input_ids)  # noqa: E731
    num = args.num_prompts or 64
    per_rate = [build_workload(args, num, count_tokens=count, seed_offset=i)
                for i in range(num_rates)]
    warmup = build_workload(args, args.warmup, count_tokens=count, seed_offset=10_000) \
        if args.warmup > 0 else []
    return warmup, per_rate


def run(args) -> dict:
    """Run the sweep the parsed flags describe (launching heron if asked); print tables and
    the JSON line; return the record."""
    if bool(args.url) == bool(args.launch):
        raise ValueError("give exactly one of --url URL or --launch")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    rates, slo = parse_rates(args.request_rates), SLO.parse(args.slo)
    warmup, per_rate = _samples(args, len(rates))
    machine, proc = machine_info(), None
    if args.launch:
        from heron.bench import launch

        proc, url = launch.start(args.server_args)
    else:
        url = args.url
    try:
        endpoint = _endpoint(args, url)
        server, rows = asyncio.run(sweep(endpoint, warmup, per_rate, rates, args, slo))
    finally:
        if proc is not None:
            launch.stop(proc)
    label = args.label or ("heron" if args.launch else server["owned_by"]
                           or urlparse(url).netloc)
    print_tables(rows, slo)
    record = {"kind": "serve", "label": label, "engine": server["owned_by"],
              "machine": machine, "server": server, "slo": slo.as_dict(),
              "config": _config(args, url, len(per_rate[0])), "results": rows}
    emit(record, args.json_out)
    return record


def _config(args, url: str, num: int) -> dict:
    keys = ("endpoint", "model", "workload", "input_len", "output_len", "prefix_len",
            "num_prefixes", "dataset", "seed", "request_rates", "arrival", "burstiness",
            "max_concurrency", "timeout", "server_args", "warmup")
    return {k: getattr(args, k) for k in keys} | {
        "url": url, "num_prompts": num, "stream": not args.no_stream,
        "ignore_eos": not args.no_ignore_eos,
        "output_len": args.output_len or args._default_output}


def print_tables(rows: list[dict], slo: SLO) -> None:
    """Counts and throughput per rate, then latency percentiles (ms) per rate."""
    print(format_table(
        ["rate", "ok", "429", "err", "uptime", "req/s", "in tok/s", "out tok/s", "goodput"],
        [[r["request_rate"], r["completed"], r["rejected_429"], r["errors"], r["uptime"],
          r["request_throughput"], r["input_token_throughput"], r["output_token_throughput"],
          r["goodput"]] for r in rows]))
    print(f"goodput: requests/s meeting the SLO {slo.as_dict() or '(none: every success)'}\n")
    print(format_table(
        ["rate", "metric (ms)", "mean", "p50", "p90", "p99"],
        [[r["request_rate"], m, *(r[f"{m}_ms"][k] for k in ("mean", "p50", "p90", "p99"))]
         for r in rows for m in ("ttft", "tpot", "itl", "e2e")]))
