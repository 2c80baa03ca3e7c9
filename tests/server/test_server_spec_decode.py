"""`heron serve --speculative-config`: streamed greedy completions equal the server without
speculation, and the spec_decode metrics (vLLM's names under heron:) and /stats report it."""

from __future__ import annotations

import json

import httpx
import pytest

from server_fixture import HeronServer, make_tiny_served_model

PROMPT = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_served_model(tmp_path_factory.mktemp("served-spec"))


def _stream(server: HeronServer) -> list[str]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "stream": True, "ignore_eos": True}
    pieces = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return pieces


def test_served_speculation_streams_the_same_text_and_reports_metrics(model_dir):
    plain = HeronServer(str(model_dir), "--served-model-name", "m")
    try:
        want = "".join(_stream(plain))
    finally:
        plain.stop()
    spec = json.dumps({"method": "draft", "model": str(model_dir),
                       "num_speculative_tokens": 3})
    server = HeronServer(str(model_dir), "--served-model-name", "m",
                         "--speculative-config", spec)
    try:
        pieces = _stream(server)
        assert "".join(pieces) == want
        stats = server.wait_for(lambda s: s["spec_decode"] is not None
                                and s["spec_decode"]["num_drafts"] > 0)
        assert stats["spec_decode"]["acceptance_rate"] == 1.0  # the model drafting for itself
        assert stats["spec_decode"]["mean_acceptance_length"] > 1
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        for name in ("heron:spec_decode_num_drafts_total",
                     "heron:spec_decode_num_draft_tokens_total",
                     "heron:spec_decode_num_accepted_tokens_total",
                     'heron:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'):
            assert name in text, name
    finally:
        server.stop()


def test_bad_speculative_config_fails_at_startup_with_a_clear_error(model_dir):
    with pytest.raises(RuntimeError, match="unknown speculative method"):
        HeronServer(str(model_dir), "--speculative-config", '{"method": "medusa"}',
                    startup_timeout=60)
