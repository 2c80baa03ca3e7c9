"""The API edge loads no torch: the HTTP server app, its protocol models, the engine client,
the prefix cache's block hashing and the KV-event decoder (what a router or gateway imports)
import without it, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE_MODULES = ("heron.server.app", "heron.server.protocol", "heron.transport.async_client",
                      "heron.engine.prefix_cache", "heron.engine.kv_events")

_CHECK = f"""
import importlib, sys
for name in {TORCH_FREE_MODULES!r}:
    importlib.import_module(name)
    if "torch" in sys.modules:
        sys.exit(f"importing {{name}} loaded torch")

import msgspec
from heron.engine.kv_events import decode_batch
from heron.engine.prefix_cache import block_hashes
hashes = block_hashes(list(range(40)), 16, None)
ts, events = decode_batch(msgspec.msgpack.encode({{"ts": 1.0, "events": [{{"type": "x"}}]}}))
assert len(hashes) == 2 and (ts, events) == (1.0, [{{"type": "x"}}]), (hashes, ts, events)
if "torch" in sys.modules:
    sys.exit("block hashing or event decoding loaded torch")
"""


def test_the_api_edge_imports_without_torch():
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
