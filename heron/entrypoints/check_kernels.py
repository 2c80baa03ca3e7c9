"""``heron check-kernels``: the precision-regression suite of the Triton kernels (see
``heron.kernels.check``), as a command. Exits 1 if any kernel is out of tolerance."""

from __future__ import annotations

import json
import sys

from heron.cli_help import HelpFormatter

DTYPES = ("float32", "float16", "bfloat16")


def add_parser(sub) -> None:
    p = sub.add_parser("check-kernels", help="Triton kernels vs float64 torch references",
                       formatter_class=HelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if available; cpu runs the Triton interpreter")
    p.add_argument("--shapes", choices=("auto", "small", "real"), default="auto",
                   help="auto: real (Llama-3.1-8B / Qwen3-0.6B layers) on cuda, small on cpu")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated")
    p.add_argument("--kernels", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--json-out", default=None, metavar="PATH", help="write results as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="log details")


def run(args) -> int:
    import torch

    from heron.kernels import runtime

    if not runtime.has_triton():
        print("heron: error: check-kernels needs the `triton` package", file=sys.stderr)
        return 2
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        runtime.use_interpreter()  # before the kernel modules are imported
    from heron.kernels.check import HEADER, SUITE, format_row, run_checks
    from heron.config import parse_dtype

    real = args.shapes == "real" or (args.shapes == "auto" and device == "cuda")
    dtypes = [parse_dtype(name.strip()) for name in args.dtypes.split(",")]
    kernels = args.kernels.split(",") if args.kernels else None
    unknown = set(kernels or ()) - set(SUITE)
    if unknown:
        print(f"heron: error: unknown kernels {sorted(unknown)}; known: {list(SUITE)}",
              file=sys.stderr)
        return 2
    print(f"check-kernels on {device} ({'real' if real else 'small'} shapes)")
    print(HEADER)
    checks = []
    for check in run_checks(device, dtypes, real, kernels):
        checks.append(check)
        print(format_row(check), flush=True)
    failed = [c for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)}/{len(checks)} within tolerance")
    if args.json_out:
        rows = [dict(kernel=c.kernel, dtype=str(c.dtype).removeprefix("torch."),
                     cases=c.num_cases, max_rel_error=c.max_rel_error, tolerance=c.tolerance,
                     ok=c.ok) for c in checks]
        with open(args.json_out, "w") as f:
            json.dump(dict(device=device, real_shapes=real, checks=rows), f, indent=1)
    return 1 if failed else 0
