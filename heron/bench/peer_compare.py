"""heron against one or more peer configurations (vLLM's two thread bindings, llama.cpp):
the stronger peer row is the ratio's denominator, and the table says which it was.

A row's figures are dicts of metric key -> value (None when not measured). "Stronger" is
the configuration with the highest ``output_tok_s`` (the benchmarks' headline figure); the
ratios of every metric of that row are heron / that configuration, so tok/s ratios > 1 and
ms ratios < 1 mean heron is faster.
"""

from __future__ import annotations

from heron.bench.table import format_table

THROUGHPUT = "output_tok_s"


def stronger(peers: dict[str, dict], key: str = THROUGHPUT) -> str | None:
    """The label of the peer configuration with the highest ``key`` (the first of equals);
    None when no configuration has the figure."""
    best, best_value = None, None
    for label, figures in peers.items():
        value = figures.get(key)
        if value is not None and (best_value is None or value > best_value):
            best, best_value = label, value
    return best


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(heron: dict, peers: dict[str, dict], keys: list[str]) -> dict:
    """``{"stronger": label, "ratios": {key: heron / stronger peer}}`` for one row."""
    best = stronger(peers)
    ref = peers.get(best, {}) if best is not None else {}
    return {"stronger": best, "ratios": {k: ratio(heron.get(k), ref.get(k)) for k in keys}}


def format_comparison(rows: list[tuple[str, dict, dict, dict]],
                      metrics: list[tuple[str, str]], peer_labels: list[str],
                      peer_name: str = "", ratio_header: str | None = None) -> str:
    """One table: per row (title, heron figures, {peer label: figures}, compare() result)
    a line per metric, a column per peer configuration, and heron / the stronger one (named
    on the row's first line)."""
    table = []
    for title, heron, peers, cmp in rows:
        for n, (label, key) in enumerate(metrics):
            r = cmp["ratios"].get(key)
            cell = f"{r:.2f}x" if r is not None else "-"
            if n == 0 and cmp["stronger"] is not None and len(peer_labels) > 1:
                cell += f" (vs {cmp['stronger']})"
            table.append([title if n == 0 else "", label, heron.get(key),
                          *(peers.get(p, {}).get(key) for p in peer_labels), cell])
    headers = ["row", "metric", "heron", *(f"{peer_name} {p}".strip() for p in peer_labels),
               ratio_header or f"heron/{peer_name} (stronger)"]
    return format_table(headers, table)


RATIO_NOTE = ("ratio = heron / the stronger peer configuration (highest output tok/s on the "
              "row): tok/s higher is better (> 1: heron faster); ms lower is better (< 1: "
              "heron faster)")
