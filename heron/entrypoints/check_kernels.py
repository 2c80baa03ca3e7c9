"""``heron check-kernels``: the precision-regression suite, as a command. Two parts: the Triton
kernels (see ``heron.kernels.check``; needs triton, on CPU under its interpreter) and every
registered operator, heron's and the installed plugins' (``heron.kernels.plugins``; runs
wherever torch does). Exits 1 if any kernel or op is out of tolerance or fails to load or
run, 2 on bad flags."""

from __future__ import annotations

import json
import sys

from heron.cli_help import HelpFormatter

DTYPES = ("float32", "float16", "bfloat16")


def add_parser(sub) -> None:
    p = sub.add_parser("check-kernels", formatter_class=HelpFormatter,
                       help="kernels and registered ops (plugins too) vs float64 references")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if available; cpu runs the Triton interpreter")
    p.add_argument("--shapes", choices=("auto", "small", "real"), default="auto",
                   help="auto: real (Llama-3.1-8B / Qwen3-0.6B layers) on cuda, small on cpu")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="comma-separated (Triton suite; an op checks the dtypes of its cases)")
    p.add_argument("--kernels", default=None,
                   help="comma-separated Triton kernels, all or none (default: all, unless --ops "
                        "is given)")
    p.add_argument("--ops", default=None,
                   help="comma-separated registered ops, all or none (default: all, unless "
                        "--kernels is given)")
    p.add_argument("--list", action="store_true",
                   help="list the registered ops (and plugins that failed to load), then exit")
    p.add_argument("--json-out", default=None, metavar="PATH", help="write results as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="log details")


def _selection(value: str | None, other: str | None) -> list[str] | None:
    """None: all; []: none (also when only the other part was asked for); else the names."""
    if value is None:
        return [] if other is not None else None
    names = [n.strip() for n in value.split(",") if n.strip()]
    return {"none": [], "all": None}.get(",".join(names), names)


def run(args) -> int:
    import torch

    from heron.kernels import runtime

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = _selection(args.kernels, args.ops)
    ops = _selection(args.ops, args.kernels)
    if not runtime.has_triton() and kernels:
        print("heron: error: the Triton kernels need the `triton` package", file=sys.stderr)
        return 2
    if device == "cpu" and runtime.has_triton():
        runtime.use_interpreter()  # before any kernel module (a plugin's too) is imported
    from heron.kernels.plugins import registry

    reg = registry()
    if args.list:
        return _list(reg)
    unknown = set(ops or ()) - set(reg.ops) - {e.name for e in reg.errors}
    if unknown:
        print(f"heron: error: unknown ops {sorted(unknown)}; registered: {list(reg.ops)}",
              file=sys.stderr)
        return 2
    real = args.shapes == "real" or (args.shapes == "auto" and device == "cuda")
    print(f"check-kernels on {device} ({'real' if real else 'small'} shapes)")
    checks = _run_triton(args, device, real, kernels)
    if checks is None:
        return 2
    op_checks = _run_ops(reg, device, ops)
    failed = [c for c in checks if not c.ok] + [c for c in op_checks if not c.ok]
    total = len(checks) + len(op_checks)
    print(f"{total - len(failed)}/{total} within tolerance")
    if args.json_out:
        _write_json(args.json_out, device, real, checks, op_checks)
    return 1 if failed else 0


def _run_triton(args, device: str, real: bool, kernels: list[str] | None) -> list | None:
    """The Triton suite's rows (none where triton is absent and none were asked for)."""
    from heron.kernels import runtime

    if kernels == []:
        return []
    if not runtime.has_triton():
        print("triton is not installed: the Triton kernels are skipped (the ops below run)")
        return []
    from heron.config import parse_dtype
    from heron.kernels.check import HEADER, SUITE, format_row, run_checks

    unknown = set(kernels or ()) - set(SUITE)
    if unknown:
        print(f"heron: error: unknown kernels {sorted(unknown)}; known: {list(SUITE)}",
              file=sys.stderr)
        return None
    dtypes = [parse_dtype(name.strip()) for name in args.dtypes.split(",")]
    print(HEADER)
    checks = []
    for check in run_checks(device, dtypes, real, kernels):
        checks.append(check)
        print(format_row(check), flush=True)
    return checks


def _run_ops(reg, device: str, ops: list[str] | None) -> list:
    from heron.kernels.plugins.gate import HEADER, check_registry, format_row

    if ops == []:
        return []
    print(f"\nregistered ops ({len(reg.ops)}, {len(reg.errors)} failed to load)")
    print(HEADER)
    checks = []
    for check in check_registry(reg, device, ops):
        checks.append(check)
        print(format_row(check), flush=True)
    return checks


def _list(reg) -> int:
    print(f"{'op':<24} {'slot':<24} {'backend':<7} {'source':<24} description")
    for spec in reg.ops.values():
        print(f"{spec.name:<24} {spec.slot:<24} {spec.backend:<7} {spec.source:<24} "
              f"{spec.description}")
    for err in reg.errors:
        print(f"{err.name:<24} {'-':<24} {'-':<7} {err.source:<24} ERROR: failed to load: "
              f"{err.reason}")
    return 0


def _write_json(path: str, device: str, real: bool, checks: list, op_checks: list) -> None:
    rows = [dict(kernel=c.kernel, dtype=str(c.dtype).removeprefix("torch."),
                 cases=c.num_cases, max_rel_error=c.max_rel_error, tolerance=c.tolerance,
                 ok=c.ok) for c in checks]
    op_rows = [dict(op=c.op, slot=c.slot, source=c.source, dtype=c.dtype, cases=c.num_cases,
                    max_rel_error=c.max_rel_error, tolerance=c.tolerance, status=c.status,
                    reason=c.reason) for c in op_checks]
    with open(path, "w") as f:
        json.dump(dict(device=device, real_shapes=real, checks=rows, ops=op_rows), f, indent=1)
