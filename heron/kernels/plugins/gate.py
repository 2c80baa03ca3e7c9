"""The precision gate of the registered ops: each op's kernel against its float64 reference on
its own cases, one ``OpCheck`` per (op, dtype); a plugin that fails to load, raises or is out
of tolerance is a row that says so, never an exception out of the gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from heron.kernels.plugins.discovery import Registry
from heron.kernels.plugins.spec import OpSpec
from heron.kernels.reference import max_rel_error

OK, FAIL, ERROR, SKIP = "ok", "FAIL", "ERROR", "SKIP"


@dataclass(frozen=True)
class OpCheck:
    """One op at one dtype: cases run, worst relative error, and the verdict (``status`` is
    ok / FAIL (out of tolerance) / ERROR (did not load, or raised) / SKIP, with ``reason``)."""

    op: str
    slot: str
    source: str
    dtype: str
    num_cases: int
    max_rel_error: float
    tolerance: float
    status: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status in (OK, SKIP)


def _flat(out) -> torch.Tensor:
    """A tensor, or a tuple of them (e.g. norm and residual), as one flat float64 tensor."""
    parts = out if isinstance(out, (tuple, list)) else (out,)
    return torch.cat([p.detach().double().cpu().reshape(-1) for p in parts])


def _dtype_of(args: tuple) -> str:
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return str(t.dtype).removeprefix("torch.") if t is not None else "-"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def check_op(spec: OpSpec, device: str) -> list[OpCheck]:
    """``spec`` on its cases (on ``device`` where it runs there, else on CPU), by dtype."""
    dev = device if device in spec.devices else "cpu"
    row = dict(op=spec.name, slot=spec.slot, source=spec.source, tolerance=spec.tolerance)
    try:
        if spec.available is not None and not spec.available():
            return [OpCheck(**row, dtype="-", num_cases=0, max_rel_error=0.0, status=SKIP,
                            reason="unavailable here (e.g. no C++ compiler)")]
        errors: dict[str, list[float]] = {}
        with torch.inference_mode():
            for args in spec.cases(dev):
                ref = _flat(spec.reference(*args))  # first: a kernel may write in place
                err = max_rel_error(_flat(spec.run(*args)), ref)
                errors.setdefault(_dtype_of(args), []).append(err)
    except Exception as exc:  # noqa: BLE001 - a plugin's failure is its row, not ours
        return [OpCheck(**row, dtype="-", num_cases=0, max_rel_error=float("nan"),
                        status=ERROR, reason=_one_line(exc))]
    if not errors:
        return [OpCheck(**row, dtype="-", num_cases=0, max_rel_error=float("nan"),
                        status=ERROR, reason="its cases generator yielded no case")]
    checks = []
    for dtype, errs in errors.items():
        worst = max(errs)
        ok = worst <= spec.tolerance  # NaN compares False: a NaN output fails
        checks.append(OpCheck(**row, dtype=dtype, num_cases=len(errs), max_rel_error=worst,
                              status=OK if ok else FAIL,
                              reason="" if ok else f"max rel error {worst:.2e} > "
                                                   f"{spec.tolerance:.0e}"))
    return checks


def check_registry(reg: Registry, device: str, names: list[str] | None = None
                   ) -> Iterator[OpCheck]:
    """Load errors first (ERROR rows), then each op (all, or ``names``), as each finishes."""
    for err in reg.errors:
        if names is None or err.name in names:
            yield OpCheck(err.name, "-", err.source, "-", 0, float("nan"), 0.0, ERROR,
                          f"failed to load: {err.reason}")
    for name, spec in reg.ops.items():
        if names is None or name in names:
            yield from check_op(spec, device)


HEADER = (f"{'op':<24} {'slot':<24} {'dtype':<9} {'cases':>5} {'max rel err':>12} "
          f"{'tol':>7}  result")


def format_row(c: OpCheck) -> str:
    err = "-" if c.num_cases == 0 else f"{c.max_rel_error:.2e}"
    tol = f"{c.tolerance:.0e}" if c.tolerance else "-"
    tail = f"{c.status}" + (f" ({c.reason})" if c.reason else "")
    return f"{c.op:<24} {c.slot:<24} {c.dtype:<9} {c.num_cases:>5} {err:>12} {tol:>7}  {tail}"
