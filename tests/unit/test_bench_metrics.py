"""`heron bench` arithmetic on synthetic timings: percentiles, ITL, TPOT, goodput, arrivals,
workloads and cost. No engine, no server."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from heron.bench import arrivals, cost, workloads
from heron.bench.metrics import (SLO, RequestRecord, distribution, inter_chunk_latencies,
                                 summarize, time_per_output_token)
from heron.bench.report_cost import rescore


def test_distribution_interpolates_between_order_statistics():
    d = distribution([0.005, 0.001, 0.003, 0.002, 0.004])  # seconds -> ms
    assert d["mean"] == pytest.approx(3.0)
    assert d["p50"] == pytest.approx(3.0)
    assert d["p90"] == pytest.approx(4.6)   # 4 + 0.6 * (5 - 4)
    assert d["p99"] == pytest.approx(4.96)
    assert distribution([None, float("nan")]) == {"mean": None, "p50": None, "p90": None,
                                                  "p99": None}


def test_itl_and_tpot_from_chunk_timestamps():
    assert inter_chunk_latencies([0.10, 0.15, 0.30, 0.30]) == pytest.approx([0.05, 0.15, 0.0])
    assert inter_chunk_latencies([0.2]) == []
    with pytest.raises(ValueError, match="non-decreasing"):
        inter_chunk_latencies([0.3, 0.2])
    # 11 tokens: 10 gaps after the first token over 1.0 s
    assert time_per_output_token(0.1, 1.1, 11) == pytest.approx(0.1)
    assert time_per_output_token(0.1, 0.1, 1) is None
    rec = RequestRecord(status=200, output_tokens=4, ttft=0.2, e2e=0.8,
                        chunks=[0.2, 0.3, 0.6, 0.8])
    assert rec.itl == pytest.approx([0.1, 0.3, 0.2])
    assert rec.tpot == pytest.approx(0.2)
    assert RequestRecord.from_json(json.loads(json.dumps(rec.to_json()))) == rec


def test_slo_parse_and_bad_input():
    assert SLO.parse("ttft=500, TPOT=50").as_dict() == {"ttft": 500.0, "tpot": 50.0}
    assert SLO.parse(None).as_dict() == {}
    for bad, msg in (("ttft", "KEY=MS"), ("latency=3", "KEY=MS"), ("ttft=fast", "number"),
                     ("tpot=-1", "> 0")):
        with pytest.raises(ValueError, match=msg):
            SLO.parse(bad)


def _req(status=200, ttft=0.1, e2e=1.0, tokens=10, error=""):
    gaps = np.linspace(ttft, e2e, tokens).tolist() if status == 200 and not error else []
    return RequestRecord(status=status, error=error, prompt_tokens=20 if gaps else 0,
                         output_tokens=tokens if gaps else 0, ttft=ttft if gaps else None,
                         e2e=e2e, chunks=gaps)


def test_summarize_counts_goodput_and_uptime():
    records = [_req(),                              # meets the SLO
               _req(ttft=0.9, e2e=1.0),             # TTFT 900 ms > 500
               _req(ttft=0.1, e2e=3.8),             # TPOT 411 ms > 100
               RequestRecord(status=429, error="HTTP 429: busy", retry_after=2.0),
               _req(status=0, error="ReadTimeout")]
    s = summarize(records, duration=2.0, slo=SLO(ttft=500, tpot=100))
    assert (s["num_requests"], s["completed"], s["rejected_429"], s["errors"]) == (5, 3, 1, 1)
    assert s["uptime"] == pytest.approx(0.6)
    assert s["goodput"] == pytest.approx(0.5)           # 1 request / 2 s
    assert s["slo_attainment"] == pytest.approx(0.2)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_token_throughput"] == pytest.approx(15.0)
    assert s["input_token_throughput"] == pytest.approx(30.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * (0.1 + 0.0111111 + 0.4111111) / 3,
                                                 rel=1e-4)
    assert s["error_samples"] == ["ReadTimeout"] and s["retry_after_max_s"] == 2.0
    # without an SLO every success counts; with an ITL objective the worst gap decides
    assert summarize(records, 2.0)["goodput"] == pytest.approx(1.5)
    assert summarize(records[:1], 2.0, SLO(itl=99))["slo_attainment"] == 0.0
    with pytest.raises(ValueError, match="duration"):
        summarize(records, 0.0)


def test_rescore_recomputes_goodput_from_stored_requests():
    records = [_req(), _req(ttft=0.9, e2e=1.0)]
    row = {"request_rate": 1.0, "duration_s": 4.0, "requests": [r.to_json() for r in records]}
    row |= summarize(records, 4.0)
    out = rescore({"kind": "serve", "results": [row]}, SLO(ttft=500))
    assert out["results"][0]["goodput"] == pytest.approx(0.25)
    assert out["results"][0]["slo_attainment"] == pytest.approx(0.5)
    assert row["goodput"] == pytest.approx(0.5)  # the input is not modified


def test_arrival_processes():
    assert arrivals.send_times(4, 2.0, "constant") == pytest.approx([0.0, 0.5, 1.0, 1.5])
    assert arrivals.send_times(3, math.inf) == [0.0, 0.0, 0.0]
    gaps = np.diff(arrivals.send_times(20001, 5.0, "poisson", seed=1))
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    bursty = np.diff(arrivals.send_times(20001, 5.0, "gamma", burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.2, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)
    assert arrivals.parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "fast", "1,-2"):
        with pytest.raises(ValueError, match="rate"):
            arrivals.parse_rates(bad)
    with pytest.raises(ValueError, match="arrival process"):
        arrivals.send_times(2, 1.0, "bursty")


def test_workload_lengths_and_shared_prefix():
    assert workloads.parse_len("128") == (128, 128)
    assert workloads.parse_len("100:1024") == (100, 1024)
    for bad in ("0", "5:3", "a", "1:2:3"):
        with pytest.raises(ValueError, match="length"):
            workloads.parse_len(bad)
    samples = workloads.random_workload(50, "10:20", "3:5", seed=7, vocab_size=1000)
    assert all(10 <= len(s.prompt) <= 20 and 3 <= s.output_len <= 5 for s in samples)
    assert all(100 <= t < 1000 for s in samples for t in s.prompt)
    assert samples == workloads.random_workload(50, "10:20", "3:5", seed=7, vocab_size=1000)
    text = workloads.random_workload(2, "6", "4", seed=0)
    assert all(len(s.prompt.split()) == 6 for s in text)
    shared = workloads.shared_prefix_workload(6, 8, 2, "4", "2", vocab_size=500)
    assert shared[0].prompt[:8] == shared[2].prompt[:8] != shared[1].prompt[:8]
    assert all(len(s.prompt) == 12 for s in shared)


def test_sharegpt_workload(tmp_path):
    long = "word " * 30
    data = [{"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": long}]},
            {"messages": [{"role": "user", "content": long}, {"role": "assistant",
                                                              "content": long * 2}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]},
            {"conversations": [{"from": "human", "value": long}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    samples = workloads.sharegpt_workload(path, 2, count_tokens=lambda t: len(t.split()))
    assert sorted(s.output_len for s in samples) == [30, 60]
    fixed = workloads.sharegpt_workload(path, 2, output_len="7")
    assert [s.output_len for s in fixed] == [7, 7]
    with pytest.raises(ValueError, match="only 2 usable"):
        workloads.sharegpt_workload(path, 3)
    with pytest.raises(ValueError, match="only 1 usable"):
        workloads.sharegpt_workload(path, 2, max_len=80, count_tokens=lambda t: len(t.split()))
    path.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        workloads.sharegpt_workload(path, 1)


def test_cost_per_million_tokens_and_capacity():
    # $3.60 per GPU-hour = $0.001 per second; 1,000 tokens/s -> $1 per million tokens
    blended = cost.efficiency(0.0, 1000.0, 1, 3.6)
    assert blended["usd_per_m_output"] == pytest.approx(1.0)
    assert blended["split"] == "blended"
    # 2 GPUs, 3,000 input + 1,000 output tokens/s, prefill at 10,000 tokens/s: input takes
    # 30% of each second, output 70%
    t = cost.token_time(3000.0, 1000.0, 2, prefill_tok_s=10_000.0)
    assert t.input_s == pytest.approx(2 * 0.3 / 3000)
    assert t.output_s == pytest.approx(2 * 0.7 / 1000)
    eff = cost.efficiency(3000.0, 1000.0, 2, 3.6, prefill_tok_s=10_000.0)
    assert eff["usd_per_m_input"] == pytest.approx(0.2)
    assert eff["usd_per_m_output"] == pytest.approx(1.4)
    assert eff["usd_per_m_blended"] == pytest.approx(0.5)
    assert eff["tok_s_per_gpu"] == pytest.approx(2000.0)
    # the measured mix at 5 req/s (600 in + 200 out per request) needs 2 GPUs per 5 req/s
    assert cost.gpus_needed(5.0, 600, 200, t) == 2
    assert cost.gpus_needed(12.0, 600, 200, t) == 5
    assert cost.gpus_needed(5.0, 600, 400, t) == 4   # twice the output: 5 x 0.68 = 3.4
    rows = [{"request_rate": 1.0, "slo_attainment": 1.0},
            {"request_rate": 4.0, "slo_attainment": 0.95},
            {"request_rate": "inf", "slo_attainment": 0.5}]
    assert cost.highest_passing(rows, 0.9)["request_rate"] == 4.0
    assert cost.highest_passing(rows, 0.4)["request_rate"] == "inf"
    assert cost.highest_passing(rows[2:], 0.9) is None
    with pytest.raises(ValueError):
        cost.token_time(100.0, 0.0)
