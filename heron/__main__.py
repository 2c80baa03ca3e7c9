"""``python -m heron`` is the ``heron`` command."""

import sys

from heron.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
