"""The report's cost & efficiency section (the arithmetic lives in cost.py)."""

from __future__ import annotations

import copy

from heron.bench import cost
from heron.bench.metrics import SLO, RequestRecord
from heron.bench.render import Heading, Para, Table


def rescore(rec: dict, slo: SLO) -> dict:
    """A copy of a serve record with goodput and SLO attainment recomputed under ``slo``
    from its per-request data (rows without that data keep their own numbers)."""
    rec = copy.deepcopy(rec)
    rec["slo"] = slo.as_dict()
    for row in rec["results"]:
        reqs = [RequestRecord.from_json(d) for d in row.get("requests") or []]
        if reqs:
            met = sum(slo.met_by(r) for r in reqs)
            row["slo_attainment"], row["goodput"] = met / len(reqs), met / row["duration_s"]
    return rec


def _model_key(cfg: dict) -> tuple:
    return cfg.get("model"), cfg.get("load_format", "auto"), cfg.get("dtype")


def _prefill_rates(latency: list[dict]) -> dict:
    """(engine, model key) -> (best measured prefill tokens/s, its file)."""
    best: dict[tuple, tuple[float, str]] = {}
    for rec in latency:
        for engine, runs in rec["results"].items():
            key = (engine, _model_key(rec["config"]))
            rate = max(r["prefill_tok_s"] for r in runs)
            if rate > best.get(key, (0.0, ""))[0]:
                best[key] = (rate, rec["_source"])
    return best


def _prefill_for(point: dict, rates: dict, override: float | None) -> tuple[float | None, str]:
    """The prefill rate to split a point's cost by, and where it came from. Offline points
    match engine and model; a serve point (whose model path is unknown here) matches an
    engine measured on exactly one model."""
    if override is not None:
        return override, "--prefill-tok-s"
    if point["model"] is not None:
        hit = rates.get((point["engine"], point["model"]))
    else:
        hits = [v for (engine, _), v in rates.items() if engine == point["engine"]]
        hit = hits[0] if len(hits) == 1 else None
    return (hit[0], f"`{hit[1]}`") if hit else (None, "")


def _operating_points(by_kind: dict, attainment: float) -> list[dict]:
    """(label, engine, where, input tok/s, output tok/s, tokens per request) to cost."""
    points = []
    for rec in by_kind["throughput"]:
        for engine, r in rec["results"].items():
            n = r["num_requests"]
            points.append({"label": f"{engine} offline", "engine": engine,
                           "model": _model_key(rec["config"]),
                           "where": f"`{rec['_source']}` (no latency SLO)",
                           "in": r["input_tok_s"], "out": r["output_tok_s"],
                           "mix": (r["input_tokens"] / n, r["output_tokens"] / n)})
    for rec in by_kind["serve"]:
        row = cost.highest_passing(rec["results"], attainment)
        if row is None or not row["completed"] or not row["output_token_throughput"]:
            points.append({"label": rec["label"], "engine": rec.get("engine"), "model": None,
                           "where":
                           f"`{rec['_source']}`: no rate met the SLO", "in": None})
            continue
        n = row["completed"]
        points.append({"label": rec["label"], "engine": rec.get("engine"), "model": None,
                       "where": f"{_rate_text(row['request_rate'])}, the highest meeting "
                                f"the SLO",
                       "in": row["input_token_throughput"],
                       "out": row["output_token_throughput"],
                       "mix": (row["total_input_tokens"] / n, row["total_output_tokens"] / n)})
    return points


def _usd(value: float | None) -> str | None:
    """Dollars with 2 decimals, or 3 significant digits below $1 (cents of a cent matter)."""
    if value is None:
        return None
    return f"${value:,.2f}" if value >= 1 else f"${value:.3g}"


def _rate_text(rate) -> str:
    return "all at once (rate inf)" if rate == "inf" else f"rate {rate:g} req/s"


def _slo_table(serve: list[dict], attainment: float) -> Table:
    rows = []
    for rec in serve:
        row = cost.highest_passing(rec["results"], attainment)
        if row is None:
            rows.append([rec["label"], str(rec.get("slo") or "-"), "none", None, None, None,
                         None])
            continue
        rows.append([rec["label"], str(rec.get("slo") or "-"), row["request_rate"],
                     row["request_throughput"], f"{100 * row['slo_attainment']:.0f}%",
                     row["ttft_ms"]["p99"], row["tpot_ms"]["p99"]])
    return Table(["server", "SLO (ms)", "highest rate", "achieved req/s", "attainment",
                  "TTFT p99", "TPOT p99"], rows)


def cost_section(by_kind: dict, opts) -> list:
    """Efficiency and cost per operating point, the SLO table, and the capacity plan."""
    points = _operating_points(by_kind, opts.attainment)
    if not points:
        return []
    prefill = _prefill_rates(by_kind["latency"])
    price = (f"${opts.gpu_hour_price:.2f} per GPU-hour" if opts.gpu_hour_price is not None
             else "no --gpu-hour-price given (costs left blank)")
    blocks = [Heading(2, "Cost & efficiency"),
              Para(f"Assumes {opts.num_gpus} GPU(s) per measured deployment at {price} (a "
                   f"machine without a GPU counts as one device). Input and output tokens "
                   f"share the cost by the time prefill takes at the prefill rate measured by "
                   f"`bench latency` ('prefill share'), else equally ('blended'). A serve run "
                   f"is costed at its highest rate where >= {100 * opts.attainment:.0f}% of "
                   f"requests meet the SLO.")]
    rows, plans = [], []
    for pt in points:
        if pt["in"] is None:
            rows.append([pt["label"], pt["where"], *[None] * 6])
            continue
        rate, origin = _prefill_for(pt, prefill, opts.prefill_tok_s)
        eff = cost.efficiency(pt["in"], pt["out"], opts.num_gpus, opts.gpu_hour_price, rate)
        split = f"{eff['split']} ({rate:,.0f} tok/s, {origin})" if rate else eff["split"]
        rows.append([pt["label"], pt["where"], eff["tok_s_per_gpu"],
                     eff["output_tok_s_per_gpu"], _usd(eff["usd_per_m_input"]),
                     _usd(eff["usd_per_m_output"]), _usd(eff["usd_per_m_blended"]), split])
        if opts.target_rate:
            plans.append(_plan_row(pt, opts, rate))
    blocks.append(Table(["deployment", "operating point", "tok/s per GPU", "out tok/s per GPU",
                         "$ / M input", "$ / M output", "$ / M blended", "split"], rows))
    if by_kind["serve"]:
        blocks += [Heading(3, "Highest rate meeting the SLO"),
                   _slo_table(by_kind["serve"], opts.attainment)]
    if plans:
        blocks += [Heading(3, f"Capacity plan for {opts.target_rate:g} req/s"),
                   Para("GPUs needed at each deployment's costed operating point, for the "
                        "target token mix (default: the measured mean per request)."),
                   Table(["deployment", "input tok / req", "output tok / req", "GPUs needed"],
                         plans)]
    return blocks


def _plan_row(pt: dict, opts, prefill_rate: float | None) -> list:
    t = cost.token_time(pt["in"], pt["out"], opts.num_gpus, prefill_rate)
    mix_in = opts.target_input_len if opts.target_input_len is not None else pt["mix"][0]
    mix_out = opts.target_output_len if opts.target_output_len is not None else pt["mix"][1]
    return [pt["label"], mix_in, mix_out, cost.gpus_needed(opts.target_rate, mix_in, mix_out, t)]
