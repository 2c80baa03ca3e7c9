"""heron's weight-only quantized CPU linear layer (``torch.ops.heron_cpu.quant_linear``) against
the float32 layer heron runs today, on SmolLM2-135M's projection shapes.

    .venv/bin/python benchmarks/quant_linear.py                # 1 thread
    .venv/bin/python benchmarks/quant_linear.py --threads 2 --rows 1,64

float32 is what ``layers/cpu_gemm.py`` picks: ``F.linear`` with a column-major weight up to 3
rows, oneDNN's packed weight (``torch.ops.mkldnn._reorder_linear_weight`` +
``_linear_pointwise``) above. Quantized formats: 4-bit groups of 32, 64 and 128 (128 only
where it divides K: not 576), 8-bit per channel, 6-bit groups of 16. Every format cycles
through enough copies of its weight to overflow the last-level cache (``--working-set`` MiB),
so weights come from memory as in a real forward. The variants take turns, one pass over
their copies each, ``--reps`` times; prints the median microseconds per call and each
format's speed-up over float32 (> 1: faster), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from heron.quant.int_layout import GroupedIntWeight

SHAPES = {  # (out_features N, in_features K)
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
FORMATS = {"q4g32": (4, 32), "q4g64": (4, 64), "q4g128": (4, 128), "q8ch": (8, None),
           "q6g16": (6, 16)}  # (bits, group size; None: per channel)
GEMV_MAX_ROWS = 3  # layers/cpu_gemm.py: column-major F.linear up to here, oneDNN above


def _quantized(n: int, k: int, bits: int, group: int | None, g: torch.Generator):
    group = group or k
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
    mins = -(1 << (bits - 1)) * scales
    return GroupedIntWeight.from_values(q, scales, mins, group, bits)


def _copies(nbytes: int, working_set: int) -> int:
    return max(1, -(-working_set // nbytes))


def _pass_us(fns: list, x: torch.Tensor) -> float:
    """One call of every copy; microseconds per call."""
    start = time.perf_counter()
    for fn in fns:
        fn(x)
    return (time.perf_counter() - start) / len(fns) * 1e6


def _fp32_fns(n: int, k: int, copies: int, g: torch.Generator) -> tuple[list, list]:
    """(column-major F.linear, oneDNN packed) over the same copies of a float32 weight."""
    col, dnnl = [], []
    for _ in range(copies):
        w = torch.randn(n, k, generator=g)
        c = w.t().contiguous().t()
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        col.append(lambda x, c=c: F.linear(x, c))
        dnnl.append(lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(
            x, p, None, "none", [], ""))
    return col, dnnl


def _quant_fns(weights: list[GroupedIntWeight]) -> list:
    op = torch.ops.heron_cpu.quant_linear
    return [lambda x, w=w: op(x, w.qweight, w.scales, w.mins, w.group_size, w.bits)
            for w in weights]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,16,64", help="comma-separated M values")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--working-set", type=int, default=96, help="MiB per format")
    parser.add_argument("--library", help="load this prebuilt .so instead of building "
                        "heron.kernels.cpu (kernel development)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.library:
        torch.ops.load_library(args.library)
    else:
        from heron.kernels import cpu

        if not cpu.load():
            raise SystemExit("heron's CPU kernels did not build; nothing to measure")
    rows_list = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    working_set = args.working_set << 20
    g = torch.Generator().manual_seed(0)
    results = []
    header = f"{'shape':>8} {'N x K':>11} {'M':>3} {'fp32 us':>9}" + "".join(
        f" {f + ' us':>10} {'x':>5}" for f in formats)
    print(f"threads={args.threads}, working set {args.working_set} MiB per format; "
          f"x = fp32 time / format time")
    print(header)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        variants = {}
        for f in formats:
            bits, group = FORMATS[f]
            if group and k % group:
                continue
            first = _quantized(n, k, bits, group, g)
            copies = _copies(first.nbytes, working_set)
            variants[f] = _quant_fns([first] + [_quantized(n, k, bits, group, g)
                                                for _ in range(copies - 1)])
        col, dnnl = _fp32_fns(n, k, _copies(4 * n * k, working_set), g)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g)
            fns = {"fp32": col if rows <= GEMV_MAX_ROWS else dnnl, **variants}
            for v in fns.values():
                _pass_us(v[:2], x)  # warm up (allocations, oneDNN primitive creation)
            times = {v: [] for v in fns}
            for _ in range(args.reps):  # round robin, so drift on a shared machine hits all
                for v, f in fns.items():
                    times[v].append(_pass_us(f, x))
            us = {v: statistics.median(t) for v, t in times.items()}
            fp32 = us["fp32"]
            row = {"shape": name, "n": n, "k": k, "m": rows, "fp32_us": round(fp32, 1)}
            line = f"{name:>8} {f'{n}x{k}':>11} {rows:>3} {fp32:>9.1f}"
            for f in formats:
                if f not in us:
                    line += f" {'-':>10} {'-':>5}"
                    continue
                row[f + "_us"] = round(us[f], 1)
                row[f + "_speedup"] = round(fp32 / us[f], 2)
                line += f" {us[f]:>10.1f} {fp32 / us[f]:>5.2f}"
            print(line, flush=True)
            results.append(row)
        del variants, col, dnnl
    print(json.dumps({"bench": "quant_linear", "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
