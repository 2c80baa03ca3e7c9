"""``heron bench kernels``: each registered op (``heron.kernels.plugins``: heron's and the
installed plugins') timed against the built-in path of the slot it plugs into, the one a layer
runs when no op is selected (on CPU float32: heron's C++ small ops where they build).

Layer slots are timed on SmolLM2-135M's widths at a decode row count and a batched one;
a ``module:`` op on its largest check case, without a built-in to compare. Each time is the
median of ``repeats`` calls after ``warmup``; ratio = built-in / op (> 1: the op is faster).
Prints a table, then the record as one JSON line.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

SHAPES = {  # slot -> (rows, width) list; SmolLM2-135M: hidden 576, intermediate 1536
    "activation:silu_and_mul": [(1, 1536), (64, 1536)],
    "norm:rms_norm": [(1, 576), (64, 576)],
}


def _layer_args(slot: str, rows: int, width: int) -> tuple:
    gen = torch.Generator().manual_seed(rows + width)
    if slot == "activation:silu_and_mul":
        return (torch.randn(rows, 2 * width, generator=gen) * 4,)
    x, res = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    return x, torch.randn(width, generator=gen), 1e-5, res


def builtin_path(slot: str, args: tuple):
    """The call a layer makes for ``slot`` with no op selected, or None (a module slot)."""
    if slot == "activation:silu_and_mul":
        from heron.layers.activation import silu_and_mul

        return lambda: silu_and_mul(*args)
    if slot == "norm:rms_norm":
        from heron.layers.norm import RMSNorm

        x, weight, eps, residual = args
        norm = RMSNorm(weight.shape[0], eps)
        norm.weight.data.copy_(weight)
        return lambda: norm(x, residual)
    return None


def median_us(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _cases(spec) -> list[tuple[str, tuple]]:
    if spec.slot in SHAPES:
        return [(f"{r}x{w}", _layer_args(spec.slot, r, w)) for r, w in SHAPES[spec.slot]]
    largest = max(spec.cases("cpu"), key=lambda a: sum(t.numel() for t in a
                                                       if isinstance(t, torch.Tensor)))
    shape = "x".join(str(d) for d in largest[0].shape) if largest else "-"
    return [(shape, largest)]


def bench_op(spec, repeats: int, warmup: int) -> list[dict]:
    """Rows for one op: its time, the built-in's, their ratio (or the error it raised)."""
    rows = []
    if spec.available is not None and not spec.available():
        return [dict(op=spec.name, slot=spec.slot, source=spec.source, shape="-",
                     error="unavailable here (e.g. no C++ compiler)")]
    for shape, args in _cases(spec):
        row = dict(op=spec.name, slot=spec.slot, source=spec.source, shape=shape)
        try:
            with torch.inference_mode():
                row["op_us"] = median_us(lambda: spec.run(*args), repeats, warmup)
                base = builtin_path(spec.slot, args)
                row["builtin_us"] = median_us(base, repeats, warmup) if base else None
        except Exception as exc:  # noqa: BLE001 - a broken plugin is its row
            row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:120]}"
        if row.get("builtin_us") and row.get("op_us"):
            row["ratio"] = row["builtin_us"] / row["op_us"]
        rows.append(row)
    return rows


def _fmt(row: dict) -> str:
    def num(key, f="{:.1f}"):
        return f.format(row[key]) if row.get(key) is not None else "-"

    tail = row.get("error", "")
    return (f"{row['op']:<24} {row['slot']:<24} {row['shape']:<10} {num('op_us'):>10} "
            f"{num('builtin_us'):>12} {num('ratio', '{:.2f}x'):>7}  {tail}")


def run(args) -> None:
    from heron.kernels.plugins import registry

    if args.threads:
        torch.set_num_threads(args.threads)
    reg = registry()
    names = [n for n in args.ops.split(",") if n] if args.ops else list(reg.ops)
    for name in names:
        reg.get(name)  # ValueError for an unknown name
    print(f"{'op':<24} {'slot':<24} {'shape':<10} {'op us':>10} {'built-in us':>12} "
          f"{'ratio':>7}")
    rows = []
    for name in names:
        for row in bench_op(reg.ops[name], args.repeats, args.warmup):
            rows.append(row)
            print(_fmt(row), flush=True)
    for err in reg.errors:
        print(f"{err.name:<24} failed to load: {err.reason}")
    record = dict(bench="kernels", threads=torch.get_num_threads(), repeats=args.repeats,
                  rows=rows, load_errors=[e.__dict__ for e in reg.errors])
    print(json.dumps(record))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(record, f, indent=1)
