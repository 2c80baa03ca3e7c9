"""heron's C++ CPU kernels (paged attention: decode, and any mix of ragged query chunks;
StreamingLLM's batched decode over sinks and windows; the weight-only quantized linear layer
over ``heron.quant.int_layout``; a layer's small ops: RMSNorm, rotary, SiLU-and-mul, the
KV-cache write; the LayerStack that runs a decoder's layers in one call; a caching CPU
allocator), compiled once per machine.

``load()`` builds the ``.cpp`` files of ``_SOURCES`` (and the headers next to them) into one
library with torch's extension builder (ninja + the system C++ compiler, cached under
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``) and registers
``torch.ops.heron_cpu.*``. Without a compiler it returns False once, with a warning, and
callers keep the reference torch path.
``python -m heron.kernels.cpu`` builds ahead of time.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

from heron.logging_config import waiting

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "paged_attention.cpp", _DIR / "quant_linear.cpp", _DIR / "quant_linear_int8.cpp",
            _DIR / "small_ops.cpp", _DIR / "layer_stack.cpp", _DIR / "caching_allocator.cpp",
            _DIR / "streaming_attention.cpp"]


def _headers_digest() -> str:
    """A digest of the headers: torch's builder rebuilds when the sources or the flags change,
    and the headers reach it only through this flag."""
    digest = hashlib.sha256()
    for header in sorted(_DIR.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def load() -> bool:
    """True when ``torch.ops.heron_cpu.*`` (paged attention, ``quant_linear``, the small ops of
    ``small_ops.cpp``) are available."""
    try:
        from torch.utils import cpp_extension

        with waiting(logger, "compiling heron's C++ CPU kernels (once per machine and "
                             "source version, about a minute)"):
            cpp_extension.load(name="heron_cpu", sources=[str(s) for s in _SOURCES],
                               is_python_module=False,
                               extra_cflags=["-O3", "-march=native", "-fopenmp",
                                             f"-DHERON_CPU_HEADERS={_headers_digest()}"],
                               extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja: fall back, say why once
        logger.warning("heron's CPU kernels are unavailable (%s); using the reference "
                       "torch path", str(exc).strip().splitlines()[0] if str(exc) else exc)
        return False
    return True
