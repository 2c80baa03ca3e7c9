"""heron's C++ CPU kernels (paged decode attention), compiled once per machine.

``load()`` builds ``paged_attention.cpp`` with torch's extension builder (ninja + the system
C++ compiler, cached under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``) and
registers ``torch.ops.heron_cpu.*``. Without a compiler it returns False once, with a warning,
and callers keep the reference torch path. ``python -m heron.kernels.cpu`` builds ahead of time.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.cpp")


@functools.cache
def load() -> bool:
    """True when ``torch.ops.heron_cpu.paged_decode_attention`` is available."""
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name="heron_cpu", sources=[str(_SOURCE)], is_python_module=False,
                           extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja: fall back, say why once
        logger.warning("heron's CPU attention kernel is unavailable (%s); using the reference "
                       "torch path", str(exc).strip().splitlines()[0] if str(exc) else exc)
        return False
    return True
