"""What an operator plugin declares: ``OpSpec`` (its kernel, a float64 reference, the cases to
check, the slot it plugs into), and the slots heron's layers offer.

A slot names the call an op replaces and fixes the kernel's signature:

* ``activation:silu_and_mul``: ``kernel(gate_up)`` with gate_up (T, 2 * d), gate first, returns
  (T, d); the MLP's activation (``heron.layers.activation.silu_and_mul``).
* ``norm:rms_norm``: ``kernel(x, weight, eps, residual)`` with x (T, H), weight (H,), residual
  (T, H) or None; returns norm(x) without a residual, else (norm(x + residual), x + residual)
  (``heron.layers.norm.RMSNorm``).
* ``module:<ClassName>``: ``kernel(module)`` returns the nn.Module that replaces each module of
  that class name in the model (a whole module); its cases and reference take whatever the
  plugin's check calls (``check_kernel``) takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

SLOT_KINDS = ("activation", "norm", "module")
LAYER_SLOTS = ("activation:silu_and_mul", "norm:rms_norm")
DEFAULT_TOLERANCE = 1e-3  # max |out - ref| / max |ref|


def check_slot(slot: str) -> str:
    """``slot`` if heron's layers offer it, else a ValueError naming those they do."""
    kind, _, what = slot.partition(":")
    if slot in LAYER_SLOTS or (kind == "module" and what.isidentifier()):
        return slot
    raise ValueError(f"unknown op slot {slot!r}; heron offers {', '.join(LAYER_SLOTS)} "
                     f"and module:<ClassName>")


@dataclass(frozen=True)
class OpSpec:
    """An operator heron can check, time and plug into a model.

    ``kernel`` computes the op (Triton, C++ through torch's extension loader, or torch) with
    the slot's signature; ``reference(*args)`` computes it in float64 for the same arguments;
    ``cases(device)`` yields argument tuples (tensors on ``device``: their shapes and dtypes
    are what ``heron check-kernels`` gates, at ``tolerance`` relative error). For a
    ``module:`` slot ``check_kernel(*args)`` is what the cases run (the kernel there is a
    module factory). ``devices`` lists where the kernel runs; ``backend`` ("torch", "cpp",
    "triton") says what it needs; ``available()`` False (e.g. no compiler) skips it with
    that reason. ``source`` is filled in by the registry (the distribution or "heron").
    """

    name: str
    slot: str
    kernel: Callable[..., Any]
    reference: Callable[..., Any]
    cases: Callable[[str], Iterable[tuple]]
    tolerance: float = DEFAULT_TOLERANCE
    backend: str = "torch"
    devices: tuple[str, ...] = ("cpu",)
    description: str = ""
    check_kernel: Callable[..., Any] | None = None
    available: Callable[[], bool] | None = None
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "_.-" for c in self.name):
            raise ValueError(f"op name {self.name!r}: letters, digits, '_', '.', '-' only")
        check_slot(self.slot)
        if self.backend not in ("torch", "cpp", "triton"):
            raise ValueError(f"op {self.name}: backend must be torch, cpp or triton, "
                             f"got {self.backend!r}")
        if not self.tolerance > 0:
            raise ValueError(f"op {self.name}: tolerance must be > 0")
        for attr in ("kernel", "reference", "cases"):
            if not callable(getattr(self, attr)):
                raise ValueError(f"op {self.name}: {attr} must be callable")
        if self.kind == "module" and self.check_kernel is None:
            raise ValueError(f"op {self.name}: a module slot needs check_kernel (what its "
                             f"cases run)")

    @property
    def kind(self) -> str:
        """"activation", "norm" or "module"."""
        return self.slot.partition(":")[0]

    def run(self, *args):
        """The kernel on one case's arguments (``check_kernel`` for a module slot)."""
        return (self.check_kernel or self.kernel)(*args)
