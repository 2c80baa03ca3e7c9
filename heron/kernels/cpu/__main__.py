"""Build heron's CPU kernels ahead of time: ``python -m heron.kernels.cpu``."""

import sys

from heron.kernels.cpu import load
from heron.logging_config import configure

if __name__ == "__main__":
    configure()  # the build's progress on stderr
    ok = load()
    print("heron CPU kernels:", "ready" if ok else "unavailable (the torch path is used)")
    sys.exit(0)
