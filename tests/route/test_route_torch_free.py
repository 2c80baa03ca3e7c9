"""The router process imports no torch (nor transformers, which would pull it in): checked
after real requests, in the app under a fresh interpreter and in the `heron route` process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

SCRIPT = """
import json, sys
from starlette.testclient import TestClient
from heron.route.app import build_app
from heron.route.config import RouterConfig
app = build_app(RouterConfig(worker_urls=tuple(sys.argv[1:]), policy=%r))
with TestClient(app) as client:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "stream": True}) as s:
        assert s.status_code == 200 and "[DONE]" in s.read().decode()
    assert client.get("/metrics").status_code == 200
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps(heavy))
"""

POLICIES = ["round_robin", "least_load"]
if importlib.util.find_spec("heron.route.policies.cache_aware") is not None:
    POLICIES.append("cache_aware")


@pytest.mark.parametrize("policy", POLICIES)
def test_app_handles_requests_without_importing_torch(workers, policy):
    out = subprocess.run([sys.executable, "-c", SCRIPT % policy, *workers.urls],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_heron_route_process_maps_no_torch(workers, start_router):
    router = start_router("--worker-urls", *workers.urls)
    r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    maps = Path(f"/proc/{router.proc.pid}/maps").read_text()
    assert "torch" not in maps and "transformers" not in maps
