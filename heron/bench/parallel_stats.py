"""What tensor / pipeline parallelism cost in a benchmark run: per rank, the time in
collectives (all-reduce, gather, broadcast) and in stage-to-stage send / recv, with the bytes
moved, and the pipeline bubble (the fraction of stage-time no stage computed)."""

from __future__ import annotations

from heron.worker.rank_stats import RankStats


def snapshot(engine) -> list[RankStats] | None:
    """Every rank's totals (``EngineStats.ranks``), or None for a worker in the engine's own
    process."""
    return engine.stats().ranks or None


def report(before: list[RankStats], after: list[RankStats], elapsed_s: float, tp: int, pp: int,
           hidden_size: int, num_layers: int, dtype_bytes: int) -> dict:
    """The run between two snapshots as per-rank rows plus totals.

    Per generated or prefilled token TP all-reduces 2 x layers hidden-size vectors (after
    attention and after the MLP; the embedding adds one), PP sends 2 hidden-size vectors
    (hidden and residual) per stage boundary: the expected volumes, next to what was moved.
    """
    ranks = []
    for b, a in zip(before, after):
        steps = a.steps - b.steps
        busy = a.busy_s - b.busy_s
        p2p = a.p2p_s - b.p2p_s
        ranks.append({
            "rank": a.rank, "steps": steps, "busy_s": busy,
            "collective_s": a.collective_s - b.collective_s,
            "collective_ms_per_step": 1e3 * (a.collective_s - b.collective_s) / max(steps, 1),
            "collective_bytes": a.collective_bytes - b.collective_bytes,
            "collective_calls": a.collective_calls - b.collective_calls,
            "p2p_s": p2p, "p2p_bytes": a.p2p_bytes - b.p2p_bytes,
            "compute_s": a.compute_s - b.compute_s})
    # a stage computes while any of its ranks does; TP ranks of a stage run in lockstep
    stage_compute = [max(r["compute_s"] + r["collective_s"] for r in ranks[s * tp:(s + 1) * tp])
                     for s in range(pp)]
    return {
        "ranks": ranks,
        "bubble_fraction": (1 - sum(stage_compute) / (pp * elapsed_s)) if pp > 1 else 0.0,
        "allreduce_bytes_per_token_per_rank": (2 * num_layers + 1) * hidden_size * dtype_bytes
        if tp > 1 else 0,
        "p2p_bytes_per_token_per_boundary": 2 * hidden_size * dtype_bytes if pp > 1 else 0,
    }


def format_report(rep: dict) -> str:
    lines = ["rank  steps  busy s  collectives ms/step  collective MB  p2p s  p2p MB"]
    for r in rep["ranks"]:
        lines.append(f"{r['rank']:>4}  {r['steps']:>5}  {r['busy_s']:6.1f}  "
                     f"{r['collective_ms_per_step']:>19.1f}  "
                     f"{r['collective_bytes'] / 1e6:>13.1f}  {r['p2p_s']:5.1f}  "
                     f"{r['p2p_bytes'] / 1e6:6.1f}")
    lines.append(f"pipeline bubble: {100 * rep['bubble_fraction']:.1f}% of stage time; "
                 f"expected all-reduce volume {rep['allreduce_bytes_per_token_per_rank']} "
                 f"B/token/rank, stage send {rep['p2p_bytes_per_token_per_boundary']} "
                 f"B/token/boundary")
    return "\n".join(lines)
