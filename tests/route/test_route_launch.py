"""`heron route --launch N`: the launcher starts N `heron serve` workers, each on its own port
with its own KV-events endpoint and pinned to its share of the cores, and stops them all."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from heron.route.launch import launch_workers, split_cpus, worker_command


def test_split_cpus_shares_evenly_then_round_robin():
    assert split_cpus(2, [0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert split_cpus(3, [0, 1, 2, 3, 4]) == [(0, 1), (2, 3), (4,)]
    assert split_cpus(2, [5, 1]) == [(1,), (5,)]
    assert split_cpus(3, [0, 1]) == [(0,), (1,), (0,)]  # more workers than cores
    with pytest.raises(ValueError):
        split_cpus(0, [0, 1])


def test_refuses_the_flags_it_sets():
    for flag in ("--port", "--host=0.0.0.0", "--kv-events-endpoint"):
        with pytest.raises(ValueError, match="sets it"):
            with launch_workers(1, [flag, "1"]):
                pass
    cmd = worker_command(["m"], "127.0.0.1", 8001, "tcp://127.0.0.1:5601", 2, python="py")
    assert cmd[:4] == ["py", "-m", "heron.entrypoints.cli", "serve"]
    assert cmd[-6:] == ["--port", "8001", "--kv-events-endpoint", "tcp://127.0.0.1:5601",
                        "--threads", "2"]


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (from /proc's children lists)."""
    out, todo = [], [pid]
    while todo and len(out) < 64:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _affinity(pid: int) -> set[int] | None:
    """The cores ``pid`` may run on; None if it has exited meanwhile (a short-lived helper)."""
    try:
        return os.sched_getaffinity(pid)
    except ProcessLookupError:
        return None


def _first_kv_event(endpoint: str, url: str, timeout_s: float = 20.0) -> dict:
    """Subscribe to ``endpoint``, send ``url`` a prompt of several blocks, return the first
    BlockStored event published (bounded)."""
    import zmq

    from heron.engine.kv_events import decode_batch

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    try:
        time.sleep(0.5)  # a SUB socket misses what is published before it has joined
        body = {"model": "m", "prompt": "the quick brown fox " * 20, "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + timeout_s
        while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            _topic, _seq, payload = sock.recv_multipart()
            stored = [e for e in decode_batch(payload)[1] if e["type"] == "BlockStored"]
            if stored:
                return stored[0]
        raise AssertionError(f"no BlockStored event on {endpoint} within {timeout_s} s")
    finally:
        sock.close()


def test_launches_two_pinned_workers_with_their_own_ports_and_kv_events(served_model,
                                                                        tmp_path):
    expected = split_cpus(2)
    started = time.monotonic()
    with launch_workers(2, [served_model, "--max-model-len", "512", "--served-model-name",
                            "m", "--disable-log-stats"], log_dir=tmp_path,
                        startup_timeout_s=240, stop_timeout_s=30) as workers:
        assert [w.cpus for w in workers] == expected
        assert len({w.port for w in workers}) == 2
        assert len({w.kv_events_endpoint for w in workers}) == 2
        assert not {w.port for w in workers} & {int(w.kv_events_endpoint.rsplit(":", 1)[1])
                                                for w in workers}
        for w in workers:
            assert w.url == f"http://127.0.0.1:{w.port}"
            assert httpx.get(f"{w.url}/health", timeout=5).status_code == 200
            # the server and every process it started (the engine core) keep its share
            for pid in [w.pid, *_descendants(w.pid)]:
                assert _affinity(pid) in (set(w.cpus), None), pid
            assert w.threads == max(1, len(w.cpus) - 1)
            assert f"torch threads: {w.threads} (--threads)" in Path(w.log_path).read_text()
            assert _first_kv_event(w.kv_events_endpoint, w.url)["block_hashes"]
        pids = [p for w in workers for p in (w.pid, *_descendants(w.pid))]
    for pid in pids:  # all stopped (and reaped) on exit
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert time.monotonic() - started < 300
