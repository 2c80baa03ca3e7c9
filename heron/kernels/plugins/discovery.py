"""The operator registry: heron's built-in ops (registered in-process) and those installed
packages add through the ``heron.ops`` entry-point group, discovered lazily on first use.

An entry point loads to an ``OpSpec``, a list of them, or a callable returning either (called
once, so a plugin can defer heavy imports). A plugin that fails to import, raises, returns
something else, or repeats a known name becomes a ``LoadError`` naming it and why; the other
ops stay usable.
"""

from __future__ import annotations

import functools
import importlib.metadata
import traceback
from dataclasses import dataclass, field, replace

from heron.kernels.plugins.spec import OpSpec

ENTRY_POINT_GROUP = "heron.ops"


@dataclass(frozen=True)
class LoadError:
    """An entry point that gave no usable op: its name, distribution, and why."""

    name: str
    source: str
    reason: str


@dataclass
class Registry:
    """Every op by name (built-ins first) and the plugins that failed to load."""

    ops: dict[str, OpSpec] = field(default_factory=dict)
    errors: list[LoadError] = field(default_factory=list)

    def add(self, spec: OpSpec, source: str) -> None:
        known = self.ops.get(spec.name)
        if known is not None:
            raise ValueError(f"op name {spec.name!r} is taken (by {known.source})")
        self.ops[spec.name] = replace(spec, source=source)

    def get(self, name: str) -> OpSpec:
        """The op called ``name``, or a ValueError listing the known ops and load errors."""
        if name in self.ops:
            return self.ops[name]
        failed = [e for e in self.errors if e.name == name]
        why = f": its plugin failed to load ({failed[0].reason})" if failed else ""
        raise ValueError(f"unknown op {name!r}{why}; registered: "
                         f"{', '.join(self.ops) or 'none'}")


def entry_points() -> list:
    """The installed ``heron.ops`` entry points (tests replace this)."""
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _reason(exc: BaseException) -> str:
    """One line: the exception and where in the plugin it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames \
        else ""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}" \
           f"{where}"


def _specs_of(loaded) -> list[OpSpec]:
    """An entry point's object as a list of OpSpecs, or a TypeError."""
    if callable(loaded) and not isinstance(loaded, OpSpec):
        loaded = loaded()
    specs = [loaded] if isinstance(loaded, OpSpec) else loaded
    if not isinstance(specs, (list, tuple)) or not specs or \
            not all(isinstance(s, OpSpec) for s in specs):
        raise TypeError(f"expected an OpSpec or a list of them, got {type(loaded).__name__}")
    return list(specs)


def _load_plugins(registry: Registry) -> None:
    for ep in entry_points():
        dist = getattr(getattr(ep, "dist", None), "name", None) or ep.value.split(":")[0]
        try:
            for spec in _specs_of(ep.load()):
                registry.add(spec, dist)
        except Exception as exc:  # noqa: BLE001 - any plugin failure is reported, not raised
            registry.errors.append(LoadError(ep.name, dist, _reason(exc)))


@functools.cache
def registry() -> Registry:
    """Built-in ops, then the installed plugins; discovered once per process."""
    from heron.kernels.plugins.builtin import builtin_ops

    reg = Registry()
    for spec in builtin_ops():
        reg.add(spec, "heron")
    _load_plugins(reg)
    return reg


def refresh() -> Registry:
    """Forget what was discovered (after installing a plugin) and discover again."""
    registry.cache_clear()
    return registry()
