"""The engine's Prometheus metrics, derived from ``heron.engine.stats.EngineStats`` by one table.

A row names the metric (under ``heron:``; vLLM's name where vLLM has one: dashboards, KEDA
queries and alerts depend on these names), its kind, its help and the field it reads: a
dotted path into ``EngineStats`` (a property counts). A path through a list
(``ranks.busy_s``, ``spec_decode.accepted_per_pos``) gives one series per element, labelled
``label`` = the element's index. A path through a None (no speculative decoding) reads
nothing: a gauge or counter keeps its value. Counters and histograms read the engine's totals
since it started; a total that goes down (the engine restarted) counts on from where it was.

To add a metric: a field in ``EngineStats`` (kept where its value is known) and a row here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from heron.engine.stats import EngineStats, Histogram

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"


@dataclass(frozen=True)
class EngineMetric:
    name: str  # after "heron:"; a counter's samples add "_total"
    kind: str  # GAUGE, COUNTER or HISTOGRAM
    help: str
    field: str  # dotted path into EngineStats
    label: str | None = None  # the path goes through a list: the element index's label


M = EngineMetric
ENGINE_METRICS = (
    M("num_requests_running", GAUGE, "Requests running.", "num_running"),
    M("num_requests_waiting", GAUGE, "Requests waiting.", "num_waiting"),
    M("kv_cache_usage_perc", GAUGE, "KV cache usage (1 = full).", "kv_cache_usage"),
    M("prompt_tokens", COUNTER, "Prompt tokens of the requests the engine accepted.",
      "num_prompt_tokens_total"),
    M("generation_tokens", COUNTER, "Tokens generated (aborted requests' too).",
      "num_generation_tokens_total"),
    M("num_preemptions", COUNTER, "Preemptions.", "scheduler.num_preemptions"),
    M("prefix_cache_queries", COUNTER, "Prompt tokens looked up in the prefix cache.",
      "prefix_cache.queries"),
    M("prefix_cache_hits", COUNTER, "Prompt tokens whose KV came from the prefix cache.",
      "prefix_cache.hits"),
    M("prefix_cache_hit_rate", GAUGE, "Prefix-cache hits / queries since the engine started.",
      "prefix_cache_hit_rate"),
    M("prefill_tokens_computed", COUNTER, "Prompt (and recomputed) tokens actually computed.",
      "scheduler.num_prefill_tokens"),
    M("spec_decode_num_drafts", COUNTER, "Sequence-steps that verified draft tokens.",
      "spec_decode.num_drafts"),
    M("spec_decode_num_draft_tokens", COUNTER, "Draft tokens verified.",
      "spec_decode.num_draft_tokens"),
    M("spec_decode_num_accepted_tokens", COUNTER, "Draft tokens accepted.",
      "spec_decode.num_accepted_tokens"),
    M("spec_decode_num_accepted_tokens_per_pos", COUNTER,
      "Draft tokens accepted, by position in the draft.", "spec_decode.accepted_per_pos",
      "position"),
    M("request_queue_time_seconds", HISTOGRAM,
      "Time from arrival to first scheduled, per sequence (observed when it is scheduled).",
      "scheduler.queue_time"),
    M("iteration_tokens_total", HISTOGRAM, "Tokens computed per engine step.",
      "scheduler.step_tokens"),
    M("engine_step_time_seconds", HISTOGRAM,
      "Wall time of an engine step that ran a batch (schedule, forward, outputs).",
      "step_time"),
    M("rank_steps", COUNTER, "Steps a worker rank ran (multiprocess executor).",
      "ranks.steps", "rank"),
    M("rank_busy_seconds", COUNTER, "Time a worker rank spent inside steps.",
      "ranks.busy_s", "rank"),
    M("rank_collective_seconds", COUNTER,
      "Time a worker rank spent in collectives (all-reduce, gather, broadcast), waiting for "
      "its peers included.", "ranks.collective_s", "rank"),
    M("rank_collective_bytes", COUNTER, "Bytes a worker rank contributed to collectives.",
      "ranks.collective_bytes", "rank"),
    M("rank_p2p_seconds", COUNTER,
      "Time a worker rank spent in pipeline send / recv, waiting for its peers included.",
      "ranks.p2p_s", "rank"),
    M("rank_p2p_bytes", COUNTER, "Bytes a worker rank sent or received between pipeline "
      "stages.", "ranks.p2p_bytes", "rank"),
)
del M


def read_field(obj, path: str) -> dict:
    """The values at ``path``: {None: value}, or {element index: value} through a list; {}
    through a None."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if obj is None:
            return {}
        if isinstance(obj, list):
            rest = ".".join(parts[i:])
            return {str(k): v for k, el in enumerate(obj) for v in read_field(el, rest).values()}
        obj = getattr(obj, part)
    if obj is None:
        return {}
    if isinstance(obj, list):
        return {str(k): v for k, v in enumerate(obj)}
    return {None: obj}


class _Total:
    """A running total reported by the engine, kept monotonic across engine restarts."""

    __slots__ = ("base", "last")

    def __init__(self) -> None:
        self.base = self.last = 0

    def advance(self, total) -> None:
        if total < self.last:  # the engine restarted: count on from where it was
            self.base += self.last
        self.last = total

    @property
    def value(self):
        return self.base + self.last


class EngineMetrics:
    """A collector (register it on a ``CollectorRegistry``): the table's metrics as of the
    last ``update``."""

    def __init__(self, table: tuple[EngineMetric, ...] = ENGINE_METRICS) -> None:
        self.table = table
        # row name -> {label: gauge value or _Total}; a histogram's keys are its bucket
        # indexes and "sum"
        self._series: dict[str, dict] = {row.name: {} for row in table}
        self._bounds: dict[str, list[float]] = {}  # histogram row name -> its bucket bounds
        self._created = time.time()  # counters' and histograms' "_created" samples
        self.update(EngineStats())

    def update(self, stats: EngineStats) -> None:
        for row in self.table:
            series = self._series[row.name]
            for label, value in read_field(stats, row.field).items():
                if row.kind == GAUGE:
                    series[label] = float(value)
                elif row.kind == COUNTER:
                    _advance(series, label, value)
                else:
                    self._bounds[row.name] = list(value.bounds)
                    for i, n in enumerate(value.counts):
                        _advance(series, i, n)
                    _advance(series, "sum", value.sum)

    def collect(self):
        for row in self.table:
            name, series = f"heron:{row.name}", self._series[row.name]
            if row.kind == HISTOGRAM:
                yield self._histogram(name, row.help, self._bounds[row.name], series)
                continue
            kind = GaugeMetricFamily if row.kind == GAUGE else CounterMetricFamily
            family = kind(name, row.help, labels=[row.label] if row.label else [])
            if row.label is None and None not in series:
                series = {None: 0.0 if row.kind == GAUGE else _Total()}  # nothing reported
            for label, value in series.items():
                labels = [] if label is None else [label]
                if row.kind == GAUGE:
                    family.add_metric(labels, value)
                else:
                    family.add_metric(labels, value.value, created=self._created)
            yield family

    def _histogram(self, name: str, help: str, bounds: list[float], series: dict):
        buckets, seen = [], 0
        for i, bound in enumerate(bounds + [float("inf")]):
            seen += series[i].value
            buckets.append((floatToGoString(bound), seen))
        family = HistogramMetricFamily(name, help)
        family.add_metric([], buckets, sum_value=series["sum"].value)
        family.samples.append(Sample(f"{name}_created", {}, self._created))
        return family


def _advance(series: dict, key, total) -> None:
    if key not in series:
        series[key] = _Total()
    series[key].advance(total)
