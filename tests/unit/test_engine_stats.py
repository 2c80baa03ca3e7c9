"""EngineStats, one typed struct from the core to /metrics and /stats: it crosses the
process boundary typed, every metric comes from one table row, a row is all a field needs to
become a metric, and /stats serves every field."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from heron.engine.stats import EngineStats, snapshot
from heron.server.app import ServerSettings, build_app
from heron.server.engine_metrics import COUNTER, ENGINE_METRICS, EngineMetric, EngineMetrics, \
    read_field
from heron.server.metrics import ServerMetrics
from heron.speculative.stats import SpecDecodingStats
from heron.transport import messages as m
from heron.worker.rank_stats import RankStats


def _busy_engine() -> EngineStats:
    """Stats with every part filled: speculative decoding, two ranks, observed histograms."""
    stats = EngineStats(num_running=2, num_generation_tokens_total=30, prefix_cache_enabled=True,
                        spec_decode=SpecDecodingStats(4, 12, 7, [4, 2, 1]),
                        ranks=[RankStats(0, 9, 1.5, 0.25, 4096, 36), RankStats(1, 9, 1.25, 0.5)])
    stats.prefix_cache.queries, stats.prefix_cache.hits = 40, 10
    for seconds in (0.004, 0.02, 0.3):
        stats.step_time.observe(seconds)
    stats.scheduler.step_tokens.observe(17)
    stats.scheduler.queue_time.observe(0.05)
    return stats


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_stats_cross_the_process_boundary_typed():
    stats = _busy_engine()
    wire = msgspec.msgpack.Encoder().encode(m.OutputsMsg([], stats))  # as the core sends it
    got = msgspec.msgpack.Decoder(m.OutputMsg).decode(wire)  # as the API process reads it
    assert isinstance(got.stats, EngineStats) and got.stats == stats
    assert got.stats.spec_decode.acceptance_rate == 7 / 12
    copy = snapshot(stats)
    stats.step_time.observe(1.0)
    assert copy.step_time.count == 3  # a snapshot does not move with its source


def test_every_row_reads_a_field_of_the_struct():
    stats = _busy_engine()
    for row in ENGINE_METRICS:
        assert read_field(stats, row.field), row
        assert (row.label is None) == (len(read_field(stats, row.field)) == 1
                                       and None in read_field(stats, row.field)), row


def test_histograms_and_rank_counters_render_and_grow():
    metrics = ServerMetrics()
    stats = _busy_engine()
    metrics.update_engine_stats(stats)
    s = _samples(metrics.render()[0].decode())
    assert s[("heron:engine_step_time_seconds_count", ())] == 3
    assert s[("heron:engine_step_time_seconds_bucket", (("le", "0.005"),))] == 1
    assert s[("heron:engine_step_time_seconds_bucket", (("le", "+Inf"),))] == 3
    assert s[("heron:iteration_tokens_total_sum", ())] == 17
    assert s[("heron:request_queue_time_seconds_count", ())] == 1
    assert s[("heron:rank_busy_seconds_total", (("rank", "1"),))] == 1.25
    assert s[("heron:rank_collective_seconds_total", (("rank", "0"),))] == 0.25
    assert s[("heron:spec_decode_num_accepted_tokens_per_pos_total", (("position", "2"),))] == 1
    assert s[("heron:prefix_cache_hit_rate", ())] == 0.25
    stats.step_time.observe(0.001)
    stats.ranks[1].busy_s = 2.0
    metrics.update_engine_stats(stats)
    s = _samples(metrics.render()[0].decode())
    assert s[("heron:engine_step_time_seconds_count", ())] == 4
    assert s[("heron:rank_busy_seconds_total", (("rank", "1"),))] == 2.0
    metrics.update_engine_stats(EngineStats())  # the engine restarted: totals count on
    s = _samples(metrics.render()[0].decode())
    assert s[("heron:engine_step_time_seconds_count", ())] == 4
    assert s[("heron:generation_tokens_total", ())] == 30


def test_one_row_makes_a_field_a_metric():
    row = EngineMetric("requests_finished", COUNTER, "Requests finished.",
                       "num_requests_finished_total")
    registry = CollectorRegistry()
    collector = EngineMetrics(ENGINE_METRICS + (row,))
    registry.register(collector)
    collector.update(EngineStats(num_requests_finished_total=7))
    assert _samples(generate_latest(registry).decode())[
        ("heron:requests_finished_total", ())] == 7


class _Client:
    """What /stats needs of an engine client."""

    model_name, max_model_len, vocab_size, pid = "tiny", 64, 100, 4242

    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats

    def is_alive(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return self._stats


def test_stats_route_serves_every_field():
    stats = _busy_engine()
    app = build_app(_Client(stats), ServerSettings("tiny"))

    async def get():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/stats")

    body = json.loads(asyncio.run(get()).text)
    assert set(EngineStats.__struct_fields__) <= set(body)
    assert body["num_running"] == 2 and body["engine_pid"] == 4242
    assert body["step_time"]["counts"] == stats.step_time.counts
    assert body["ranks"][1]["busy_s"] == 1.25
    assert body["spec_decode"]["acceptance_rate"] == 7 / 12  # as the summary, like before
