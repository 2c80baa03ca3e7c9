"""Entry points: `python -m heron`, lazy top-level imports, serve's engine flags."""

from __future__ import annotations

import subprocess
import sys

from heron.entrypoints.cli import build_parser


def test_prefix_cache_imports_without_torch():
    """A router imports block hashing from the engine core without loading torch."""
    code = ("import sys, heron.engine.prefix_cache as pc; "
            "print(pc.block_hashes(list(range(40)), 16, None)[:1]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_python_dash_m_heron_is_the_heron_command():
    proc = subprocess.run([sys.executable, "-m", "heron", "serve", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--max-queued-sequences" in proc.stdout


def test_serve_takes_seed_and_threads():
    args = build_parser().parse_args(["serve", "--seed", "7", "--threads", "1"])
    assert (args.seed, args.threads) == (7, 1)
