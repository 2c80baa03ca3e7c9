"""Which implementation the fused ops (RMSNorm, rotary, SiLU-and-mul) use: torch, Triton, or
heron's C++ CPU kernels.

The runner switches the Triton kernels on together with the triton attention backend, through
the step's forward context; outside a forward (unit tests, direct calls) torch runs. On CPU,
float32 tensors without autograd take ``torch.ops.heron_cpu``'s one-call versions where that
library builds (``heron.kernels.cpu``), except while dynamo traces
(``heron.worker.compiled_forward``), where inductor fuses the torch formulas itself. The kernel modules are imported only when used, so
heron runs where triton (or a compiler) is absent.

Plugin ops selected for a model (``apply_custom_ops``, from ``--custom-ops``) come before all of
these inside that model's forward; unselected slots take the paths above, bit for bit.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Callable, Iterable

import torch
from torch import nn

from heron.attention.metadata import current_forward_context
from heron.config import parse_custom_ops


def triton_ops_enabled() -> bool:
    ctx = current_forward_context()
    return ctx is not None and ctx.use_triton_ops


_cpu_kernels_built: bool | None = None  # heron.kernels.cpu.load(), asked once (it is per-step hot)


def cpu_ops_enabled(x: torch.Tensor) -> bool:
    """True where ``x`` can go through ``torch.ops.heron_cpu``'s small ops: CPU float32 with
    autograd off (they have no backward; the runner's steps run in inference mode, training an
    EAGLE head keeps the torch formulas)."""
    global _cpu_kernels_built
    if not x.is_cpu or x.dtype != torch.float32 or torch.is_grad_enabled() or \
            torch.compiler.is_compiling():
        return False
    if _cpu_kernels_built is None:
        from heron.kernels import cpu

        _cpu_kernels_built = cpu.load()
    return _cpu_kernels_built


# Plugin ops (``heron.kernels.plugins``) selected for the model whose forward is running:
# slot -> kernel, set by the hooks ``apply_custom_ops`` puts on that model; None elsewhere,
# and then every layer takes the built-in path above unchanged.
_custom: ContextVar[dict[str, Callable] | None] = ContextVar("heron_custom_ops", default=None)
# How many models in this process have layer ops selected. While none has, custom_kernel
# answers without reading the ContextVar, which dynamo cannot trace (the compiled forward,
# ``heron.worker.compiled_forward``, then sees a plain global).
_scoped_models = 0


def _forget_scoped_model() -> None:
    global _scoped_models
    _scoped_models -= 1


def custom_kernel(slot: str) -> Callable | None:
    """The kernel selected for ``slot`` (e.g. "activation:silu_and_mul") in the running
    model's forward, or None (the built-in path)."""
    if not _scoped_models:
        return None
    ops = _custom.get()
    return None if ops is None else ops.get(slot)


def custom_ops_selected() -> bool:
    """True inside the forward of a model with layer ops selected (``apply_custom_ops``)."""
    return bool(_scoped_models) and bool(_custom.get())


def apply_custom_ops(model: nn.Module, names: str | Iterable[str] | None,
                     device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Select the registered ops ``names`` for ``model``: slot -> op name. Layer slots take
    effect inside ``model``'s forward only (other models in the process keep their paths);
    a ``module:<Class>`` op replaces each such submodule now. ValueError for an unknown op, two
    ops on one slot, or an op that cannot run on ``device`` / ``dtype``."""
    from heron.kernels.plugins import registry

    reg, chosen = registry(), {}
    for name in parse_custom_ops(names):
        spec = reg.get(name)
        if spec.slot in chosen:
            raise ValueError(f"custom ops {chosen[spec.slot].name} and {name} both plug into "
                             f"{spec.slot}; select one")
        _check_runs_on(spec, torch.device(device), dtype)
        chosen[spec.slot] = spec
    layer_ops = {slot: s.kernel for slot, s in chosen.items() if s.kind != "module"}
    for slot, spec in chosen.items():
        if spec.kind == "module":
            _replace_modules(model, slot.partition(":")[2], spec.kernel)
    if layer_ops:
        _scope_to_forward(model, layer_ops)
    return {slot: s.name for slot, s in chosen.items()}


def _check_runs_on(spec, device: torch.device, dtype: torch.dtype) -> None:
    if spec.available is not None and not spec.available():
        raise ValueError(f"custom op {spec.name} is unavailable here (e.g. no C++ compiler)")
    if device.type not in spec.devices:
        raise ValueError(f"custom op {spec.name} runs on {', '.join(spec.devices)}, "
                         f"not on {device.type}")
    dtypes = {a.dtype for args in spec.cases("cpu") for a in args
              if isinstance(a, torch.Tensor) and a.is_floating_point()}
    if spec.kind != "module" and dtype not in dtypes:
        raise ValueError(f"custom op {spec.name} is checked for "
                         f"{', '.join(sorted(str(d)[6:] for d in dtypes))}, "
                         f"not {str(dtype)[6:]}")


def _replace_modules(model: nn.Module, class_name: str, factory: Callable) -> None:
    hits = [(n, m) for n, m in model.named_modules() if type(m).__name__ == class_name]
    if not hits:
        raise ValueError(f"the model has no {class_name} module to replace")
    for name, module in hits:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, factory(module))


def _scope_to_forward(model: nn.Module, ops: dict[str, Callable]) -> None:
    """Hooks that set the selection for the duration of each ``model(...)`` call."""
    tokens = []

    def enter(module, args):
        tokens.append(_custom.set(ops))

    def leave(module, args, output):
        _custom.reset(tokens.pop())

    global _scoped_models
    _scoped_models += 1
    weakref.finalize(model, _forget_scoped_model)  # a freed model no longer counts
    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
