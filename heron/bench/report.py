"""`heron bench report`: Markdown + static HTML (+ PNG plots) from result files.

Sections, each present when some input has that kind: machines, offline throughput,
latency (with roofline fractions), serving (tables and plots), cost & efficiency.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from heron.bench import plots, results
from heron.bench.machine import machine_summary
from heron.bench.metrics import SLO
from heron.bench.render import Heading, Image, Para, Table, to_html, to_markdown
from heron.bench.report_cost import cost_section, rescore


@dataclass(frozen=True)
class ReportOptions:
    """What the cost section assumes; see cost.py for the model."""

    title: str = "heron benchmark report"
    gpu_hour_price: float | None = None
    num_gpus: int = 1
    slo: SLO | None = None          # None: each serve run's own SLO
    attainment: float = 0.9          # share of requests that must meet the SLO
    target_rate: float | None = None
    target_input_len: float | None = None
    target_output_len: float | None = None
    prefill_tok_s: float | None = None


def _machines(records: list[dict]) -> list:
    rows = [[r["_source"], r["kind"], machine_summary(r.get("machine", {})),
             r.get("machine", {}).get("torch_threads"),
             r.get("machine", {}).get("loadavg_1m_at_start")] for r in records]
    return [Heading(2, "Machines"),
            Table(["file", "kind", "machine, date", "torch threads", "load (1 min) at start"],
                  rows)]


def _describe(cfg: dict, model: str | None = None) -> str:
    """One sentence on what ran; ``model`` overrides the config's (servers name their own)."""
    parts = [f"model `{model or cfg.get('model') or 'SmolLM2-135M-Instruct (embedded)'}`"]
    if cfg.get("load_format") == "dummy":
        parts.append("random (dummy) weights")
    if cfg.get("dtype"):
        parts.append(cfg["dtype"])
    if cfg.get("workload"):
        parts.append(f"workload {cfg['workload']}: {cfg.get('num_prompts')} prompts, input "
                     f"{cfg.get('input_len')}, output {cfg.get('output_len')} tokens")
    return "; ".join(parts) + "."


def _throughput(records: list[dict]) -> list:
    blocks = [Heading(2, "Offline throughput")]
    keys = ("requests_per_s", "input_tok_s", "output_tok_s", "total_tok_s")
    for rec in records:
        res, ratios = rec["results"], rec.get("ratios") or {}
        rows = [[name, r["path"], r.get("threads"), *(r[k] for k in keys)]
                for name, r in res.items()]
        if ratios:  # heron / the stronger peer row (older records: the only peer)
            peer = rec.get("ratio_peer") or list(res)[-1]
            rows.append([f"heron / {peer}", "", "", *(f"{ratios[k]:.2f}x" for k in keys)])
        blocks += [Para(f"`{rec['_source']}`: {_describe(rec['config'])}"),
                   Table(["engine", "path", "threads", "req/s", "input tok/s",
                          "output tok/s", "total tok/s"], rows)]
        if "identical_frac" in rec:
            blocks.append(Para(f"Greedy outputs identical to the peer's for "
                               f"{100 * rec['identical_frac']:.0f}% of requests (first token: "
                               f"{100 * rec['first_token_match_frac']:.0f}%)."))
    return blocks


def _pct(frac):
    return None if frac is None else f"{100 * frac:.1f}%"


def _latency(records: list[dict]) -> list:
    blocks = [Heading(2, "Latency (one batch of equal prompts)")]
    for rec in records:
        cfg, roof = rec["config"], rec.get("roofline")
        rows = [[name, r["batch_size"], r["prefill_tok_s"], r["decode_tok_s"],
                 r["decode_ms_per_step"], _pct(r.get("prefill_roofline_frac")),
                 _pct(r.get("decode_roofline_frac"))]
                for name, runs in rec["results"].items() for r in runs]
        blocks += [Para(f"`{rec['_source']}`: {_describe(cfg)} Input {cfg['input_len']}, "
                        f"output {cfg['output_len']} tokens; medians of {cfg['iters']} runs."),
                   Table(["engine", "batch", "prefill tok/s", "decode tok/s", "ms / step",
                          "prefill % of roofline", "decode % of roofline"], rows)]
        ratios = "; ".join(f"batch {r['batch_size']}: prefill {r['prefill_tok_s']:.2f}x, "
                           f"decode {r.get('decode_tok_s', float('nan')):.2f}x"
                           for r in rec.get("ratios") or [])
        if ratios:
            blocks.append(Para(f"heron / hf: {ratios}."))
        if roof:
            blocks.append(Para(f"Ceilings measured in the same run on {roof['device']}: copy "
                               f"{roof['copy_gb_s']:,.1f} GB/s (read + write), {roof['dtype']} "
                               f"GEMM {roof['gemm_tflop_s']:,.3f} TFLOP/s."))
    return blocks


def _serve_table(rec: dict) -> Table:
    def p(row, m, q):
        return row[f"{m}_ms"][q]

    rows = [[r["request_rate"], r["completed"], r["rejected_429"], r["errors"],
             _pct(r["uptime"]), r["request_throughput"], r["output_token_throughput"],
             r["goodput"], p(r, "ttft", "p50"), p(r, "ttft", "p99"), p(r, "tpot", "p50"),
             p(r, "tpot", "p99"), p(r, "itl", "p99"), p(r, "e2e", "p50"), p(r, "e2e", "p99")]
            for r in rec["results"]]
    return Table(["rate", "ok", "429", "err", "uptime", "req/s", "out tok/s", "goodput",
                  "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99", "E2E p50",
                  "E2E p99"], rows)


def _server_metrics(rec: dict) -> list:
    last = rec["results"][-1].get("server_metrics") if rec["results"] else None
    if not last:
        return []
    items = ", ".join(f"`{k}` {v['after']:g}" + (f" (+{v['delta']:g})" if v["delta"] else "")
                      for k, v in sorted(last.items()))
    return [Para(f"Server /metrics after the last rate: {items}.")]


def _served_model(rec: dict) -> str:
    models = rec.get("server", {}).get("models") or []
    return rec["config"].get("model") or (", ".join(models) if models else "server default")


def _serve(records: list[dict], out_dir: Path) -> list:
    blocks = [Heading(2, "Serving")]
    for rec in records:
        cfg = rec["config"]
        blocks += [Heading(3, rec["label"]),
                   Para(f"`{rec['_source']}`: {cfg['url']} ({cfg['endpoint']}, "
                        f"{'streaming' if cfg['stream'] else 'not streaming'}); "
                        f"{_describe(cfg, _served_model(rec))} Arrivals {cfg['arrival']}, "
                        f"max concurrency "
                        f"{cfg['max_concurrency'] or 'unlimited'}. Latencies in ms; goodput "
                        f"in req/s meeting the SLO {rec.get('slo') or '(none)'}."),
                   _serve_table(rec), *_server_metrics(rec)]
    blocks.append(Heading(3, "Plots"))
    for name, alt, fn in (("latency_vs_rate.png", "TTFT and TPOT vs request rate",
                           plots.latency_vs_rate),
                          ("throughput_vs_rate.png", "throughput and goodput vs request rate",
                           plots.throughput_vs_rate),
                          ("ttft_cdf.png", "TTFT CDF", lambda r, p: plots.cdf(r, "ttft", p)),
                          ("tpot_cdf.png", "TPOT CDF", lambda r, p: plots.cdf(r, "tpot", p))):
        fn(records, out_dir / name)
        blocks.append(Image(name, alt))
    return blocks


def build(records: list[dict], opts: ReportOptions, out_dir: Path) -> list:
    """The report's blocks; writes the plots into ``out_dir``."""
    by_kind = {k: [r for r in records if r["kind"] == k] for k in results.KINDS}
    if opts.slo is not None:
        by_kind["serve"] = [rescore(r, opts.slo) for r in by_kind["serve"]]
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    blocks = [Heading(1, opts.title),
              Para(f"Generated {now} by `heron bench report` from "
                   f"{', '.join('`' + r['_source'] + '`' for r in records)}."),
              *_machines(records)]
    if by_kind["throughput"]:
        blocks += _throughput(by_kind["throughput"])
    if by_kind["latency"]:
        blocks += _latency(by_kind["latency"])
    if by_kind["serve"]:
        blocks += _serve(by_kind["serve"], out_dir)
    return blocks + cost_section(by_kind, opts)


def write(paths: list[str], out_dir: str | Path, opts: ReportOptions, html: bool = True
          ) -> list[Path]:
    """Load the result files and write report.md (+ report.html) and the plots; the paths."""
    if not paths:
        raise ValueError("give at least one result file")
    records = [results.load(p) for p in paths]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    blocks = build(records, opts, out)
    written = [out / "report.md"]
    written[0].write_text(to_markdown(blocks))
    if html:
        written.append(out / "report.html")
        written[1].write_text(to_html(blocks, opts.title))
    return written + sorted(out.glob("*.png"))
