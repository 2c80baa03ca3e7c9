"""Entry points: `python -m heron`, lazy top-level imports, serve's engine flags."""

from __future__ import annotations

import subprocess
import sys

from heron.entrypoints.cli import build_parser


def test_python_dash_m_heron_is_the_heron_command():
    proc = subprocess.run([sys.executable, "-m", "heron", "serve", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--max-queued-sequences" in proc.stdout


def test_serve_takes_seed_and_threads():
    args = build_parser().parse_args(["serve", "--seed", "7", "--threads", "1"])
    assert (args.seed, args.threads) == (7, 1)
