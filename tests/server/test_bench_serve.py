"""`heron bench serve` and `report`: the OpenAI stream client against a scripted ASGI app,
then a real sweep against `heron serve` on 127.0.0.1 turned into Markdown + HTML + PNGs."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from heron.bench.cli import main as bench_main
from heron.bench.http_client import Endpoint, send
from heron.bench.workloads import Sample


def _sse(*events) -> StreamingResponse:
    async def gen():
        for e in events:
            yield f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n"
    return StreamingResponse(gen(), media_type="text/event-stream")


def _text(t):
    return {"choices": [{"index": 0, "text": t}]}


async def _completions(request: Request):
    """The prompt names the behaviour to script."""
    body = await request.json()
    mode = body["prompt"]
    if mode == "busy":
        return JSONResponse({"error": {"message": "queue full"}}, status_code=429,
                            headers={"Retry-After": "1"})
    if mode == "no-usage":
        return _sse(_text("a"), _text(""), _text("b"), _text("c"), "[DONE]")
    if mode == "usage":
        return _sse(_text("ab"), _text("cd"), {"choices": [], "usage": {
            "prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}}, "[DONE]")
    if mode == "error-event":
        return _sse(_text("a"), {"error": {"message": "engine died"}})
    if mode == "truncated":
        return _sse(_text("a"), _text("b"))
    if mode == "plain":
        assert body["stream"] is False
        return JSONResponse({"choices": [{"text": "xyz"}], "usage": {
            "prompt_tokens": 3, "completion_tokens": 3}})
    return Response("nope", status_code=500)


async def _chat(request: Request):
    body = await request.json()
    assert body["messages"][0]["content"] == "hi" and body["ignore_eos"] is True
    return _sse({"choices": [{"delta": {"role": "assistant"}}]},
                {"choices": [{"delta": {"content": "Hel"}}]},
                {"choices": [{"delta": {"content": "lo"}}]}, "[DONE]")


APP = Starlette(routes=[Route("/v1/completions", _completions, methods=["POST"]),
                        Route("/v1/chat/completions", _chat, methods=["POST"])])


def _send(prompt: str, **endpoint_kw):
    endpoint = Endpoint.from_url("http://test/v1", **endpoint_kw)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=APP)) as client:
            return await send(client, endpoint, Sample(prompt, 4), timeout=10)
    return asyncio.run(go())


def test_stream_client_records_what_the_server_did():
    busy = _send("busy")
    assert busy.status == 429 and not busy.ok and busy.retry_after == 1.0
    no_usage = _send("no-usage")  # one token per non-empty chunk
    assert no_usage.ok and no_usage.output_tokens == 3 and len(no_usage.chunks) == 3
    assert no_usage.ttft == no_usage.chunks[0] <= no_usage.e2e
    usage = _send("usage")
    assert usage.ok and (usage.prompt_tokens, usage.output_tokens) == (7, 4)
    assert len(usage.chunks) == 2
    assert "engine died" in _send("error-event").error
    assert "without [DONE]" in _send("truncated").error
    assert "HTTP 500" in _send("other").error
    plain = _send("plain", stream=False)
    assert plain.ok and plain.output_tokens == 3 and plain.ttft == plain.chunks[0]
    chat = _send("hi", kind="chat")
    assert chat.ok and chat.output_tokens == 2  # the role-only chunk carries no output


def test_endpoint_urls_and_body():
    a, b = Endpoint.from_url("http://h:1/"), Endpoint.from_url("http://h:1/v1")
    assert a.path == b.path == "http://h:1/v1/completions" and a.root == "http://h:1"
    body = Endpoint.from_url("http://h:1", model="m", ignore_eos=False).body(Sample("p", 9))
    assert body["max_tokens"] == 9 and body["model"] == "m" and "ignore_eos" not in body
    assert body["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="--url"):
        Endpoint.from_url("localhost:8000")


def test_bad_serve_and_report_input(tmp_path, capsys):
    assert bench_main(["serve"]) == 2
    assert "--url URL or --launch" in capsys.readouterr().err
    assert bench_main(["serve", "--url", "http://127.0.0.1:9", "--request-rates", "0"]) == 2
    assert "rates must be > 0" in capsys.readouterr().err
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"hello": 1}')
    assert bench_main(["report", str(bogus), "--out-dir", str(tmp_path)]) == 2
    assert "not a heron bench result" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server_args():
    return ("--max-num-seqs", "8")


def _data_pixels(path) -> int:
    """Coloured pixels: the data curves (axes, grid and text are grey)."""
    import matplotlib.image

    rgb = matplotlib.image.imread(path)[..., :3]
    return int((rgb.max(axis=-1) - rgb.min(axis=-1) > 0.3).sum())


def test_serve_sweep_and_report(server, tmp_path):
    result = tmp_path / "serve.json"
    rc = bench_main(["serve", "--url", server.url, "--num-prompts", "4", "--input-len", "12",
                     "--output-len", "6", "--request-rates", "8,inf", "--slo",
                     "ttft=60000,tpot=60000", "--timeout", "120", "--no-progress",
                     "--json-out", str(result)])
    assert rc == 0
    record = json.loads(result.read_text())
    assert record["label"] == "heron" and record["server"]["owned_by"] == "heron"
    assert [r["request_rate"] for r in record["results"]] == [8.0, "inf"]
    for row in record["results"]:
        assert (row["completed"], row["errors"], row["rejected_429"]) == (4, 0, 0)
        assert row["uptime"] == 1.0 and row["slo_attainment"] == 1.0
        assert row["total_output_tokens"] == 24  # ignore_eos: exactly 6 tokens each
        assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"]
        assert row["tpot_ms"]["mean"] > 0 and row["itl_ms"]["p50"] > 0
        assert len(row["requests"]) == 4
        assert any("kv_cache" in k for k in row["server_metrics"])
    # each rate sends fresh prompts: the second cannot hit the first one's cached prefixes
    hits = [v for k, v in record["results"][1]["server_metrics"].items() if "cache_hits" in k]
    assert all(v["delta"] == 0 for v in hits)
    out = tmp_path / "report"
    rc = bench_main(["report", str(result), "--out-dir", str(out), "--gpu-hour-price", "2.5",
                     "--target-rate", "3", "--slo", "ttft=60000"])
    assert rc == 0
    md = (out / "report.md").read_text()
    assert "## Serving" in md and "## Cost & efficiency" in md
    assert "![TTFT CDF](ttft_cdf.png)" in md and "GPUs needed" in md
    assert "<table>" in (out / "report.html").read_text()
    for name in ("latency_vs_rate", "throughput_vs_rate", "ttft_cdf", "tpot_cdf"):
        assert _data_pixels(out / f"{name}.png") > 100, name
