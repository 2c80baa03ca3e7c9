"""PNG plots of serve results: latency and throughput vs request rate, TTFT/TPOT CDFs.

Each function takes serve records (one per server/label) and writes one small PNG. Rates sit
on a categorical axis so that 'inf' (everything at once) has a place after the finite ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from heron.bench.metrics import RequestRecord

DPI = 90


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def _rate_axis(records: list[dict]) -> list[str]:
    rates = {str(r["request_rate"]) for rec in records for r in rec["results"]}
    return sorted(rates, key=float)


def _series(rec: dict, axis: list[str], get) -> list[float]:
    by_rate = {str(r["request_rate"]): get(r) for r in rec["results"]}
    return [np.nan if by_rate.get(x) is None else by_rate[x] for x in axis]


def _finish(fig, axes, axis: list[str], path: Path) -> Path:
    for ax in axes:
        ax.set_xticks(range(len(axis)), axis)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return path


def latency_vs_rate(records: list[dict], path: Path) -> Path:
    """TTFT and TPOT (P50 solid, P99 dashed) against the offered rate, per label."""
    plt, axis = _pyplot(), _rate_axis(records)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for metric, ax in zip(("ttft", "tpot"), axes):
        for i, rec in enumerate(records):
            color = f"C{i}"
            for p, style in (("p50", "-"), ("p99", "--")):
                key = f"{metric}_ms"
                ax.plot(range(len(axis)), _series(rec, axis, lambda r, k=key, q=p: r[k][q]),
                        style, marker="o", color=color, label=f"{rec['label']} {p}")
        ax.set_ylabel(f"{metric.upper()} (ms)")
    return _finish(fig, axes, axis, path)


def throughput_vs_rate(records: list[dict], path: Path) -> Path:
    """Output tokens/s, and requests/s (all vs meeting the SLO), against the offered rate."""
    plt, axis = _pyplot(), _rate_axis(records)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for i, rec in enumerate(records):
        color, x = f"C{i}", range(len(axis))
        axes[0].plot(x, _series(rec, axis, lambda r: r["output_token_throughput"]), "-o",
                     color=color, label=rec["label"])
        axes[1].plot(x, _series(rec, axis, lambda r: r["request_throughput"]), "-o",
                     color=color, label=f"{rec['label']} completed")
        axes[1].plot(x, _series(rec, axis, lambda r: r["goodput"]), "--s", color=color,
                     label=f"{rec['label']} goodput")
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("requests/s")
    return _finish(fig, axes, axis, path)


def _per_request(row: dict, metric: str) -> np.ndarray:
    values = []
    for d in row.get("requests") or []:
        r = RequestRecord.from_json(d)
        v = r.ttft if metric == "ttft" else r.tpot
        if r.ok and v is not None:
            values.append(1000 * v)
    return np.sort(np.asarray(values, dtype=float))


def cdf(records: list[dict], metric: str, path: Path) -> Path:
    """Empirical CDF of ``metric`` ('ttft' or 'tpot', ms): one panel per label, one curve
    per rate. Records without per-request data are skipped."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(records), figsize=(4.5 * len(records), 3.4), squeeze=False)
    for rec, ax in zip(records, axes[0]):
        for i, row in enumerate(rec["results"]):
            xs = _per_request(row, metric)
            if xs.size:
                ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", color=f"C{i}",
                        label=f"rate {row['request_rate']}")
        ax.set_title(rec["label"], fontsize=9)
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
