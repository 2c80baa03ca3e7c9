"""Operators as plugins: ``OpSpec`` (what a plugin declares), the registry of built-in and
installed ops (entry-point group ``heron.ops``), and the precision gate that checks each
against its float64 reference (``heron check-kernels``). See ``spec`` for the slots."""

from heron.kernels.plugins.discovery import ENTRY_POINT_GROUP, LoadError, Registry, registry
from heron.kernels.plugins.spec import DEFAULT_TOLERANCE, LAYER_SLOTS, OpSpec

__all__ = ["DEFAULT_TOLERANCE", "ENTRY_POINT_GROUP", "LAYER_SLOTS", "LoadError", "OpSpec",
           "Registry", "registry"]
