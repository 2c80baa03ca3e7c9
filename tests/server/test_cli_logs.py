"""`heron serve`'s log: one format with a level on every line, from every process (the API
server, the engine core, each worker rank), and the level chosen on the command line obeyed
by all of them."""

from __future__ import annotations

import re

import httpx

from server_fixture import HeronServer

LINE = re.compile(r"^(\((core|rank\d+) pid=\d+\) )?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
                  r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) heron[\w.]*: ")


def _serve_log(*args: str) -> str:
    server = HeronServer(*args)
    try:
        body = {"prompt": "Hello", "max_tokens": 4}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code \
            == 200
    finally:
        server.stop()
    return server.log_tail(200_000)


def test_every_process_logs_one_format_with_levels(served_model):
    log = _serve_log("--model", served_model, "-tp", "2")
    lines = [line for line in log.splitlines() if line.strip()]
    odd = [line for line in lines if not LINE.match(line)]
    assert not odd, odd[:5]
    for tag in ("(core pid=", "(rank0 pid=", "(rank1 pid="):  # both ranks log, not just one
        assert any(line.startswith(tag) and " INFO " in line for line in lines), tag
    assert any(" INFO heron.server" in line for line in lines)


def test_quiet_silences_every_process(served_model):
    log = _serve_log("--model", served_model, "-tp", "2", "--quiet")
    assert " INFO " not in log, log[-2000:]
