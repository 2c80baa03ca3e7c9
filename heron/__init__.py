"""heron: an LLM inference engine and serving stack in Python.

The public names load on first use, so light modules (``heron.engine.prefix_cache``, which a
router imports for block hashes) do not pull in torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

_EXPORTS = {"LLM": "heron.engine.llm", "SamplingParams": "heron.sampling_params",
            "RequestOutput": "heron.outputs", "CompletionOutput": "heron.outputs"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'heron' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
