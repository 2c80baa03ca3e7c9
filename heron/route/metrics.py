"""The router's Prometheus metrics, under a ``heron_router:`` prefix (stable names: dashboards
and alerts depend on them). One registry per app, so in-process tests do not collide.

Per-worker gauges (health, load, breaker state, the worker's own prefix-cache hit rate) are
read from the registry at scrape time; counters and histograms are updated as requests go,
through memoized label children (``labels`` costs a lock and a validation per call, several
times per request otherwise).
"""

from __future__ import annotations

import time

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from heron.route.breaker import STATE_VALUES
from heron.route.workers import WorkerRegistry

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
P = "heron_router:"


class _Usage(msgspec.Struct):
    usage: dict | None = None


_USAGE = msgspec.json.Decoder(_Usage)


def usage_of(body: bytes) -> dict | None:
    """The ``usage`` object of a JSON response body (None when absent or not an object);
    only that field is decoded."""
    try:
        return _USAGE.decode(body).usage
    except msgspec.DecodeError:
        return None


class Children:
    """A labelled counter or histogram whose ``labels(*values)`` children are memoized (a
    child is never removed from its metric, so the memo cannot go stale)."""

    __slots__ = ("metric", "_children")

    def __init__(self, metric) -> None:
        self.metric = metric
        self._children: dict[tuple, object] = {}

    def labels(self, *values: str):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def collect(self):
        return self.metric.collect()


class RouterMetrics:
    """Counters, histograms and scrape-time gauges of one router."""

    def __init__(self, workers: WorkerRegistry, policy: str,
                 cost_per_gpu_hour: float | None = None) -> None:
        self.registry = CollectorRegistry()
        self.workers = workers
        self.policy = policy
        self.cost_per_gpu_hour = cost_per_gpu_hour
        self._started = time.monotonic()
        r = self.registry

        def counter(name: str, doc: str, labels: list[str]) -> Children:
            return Children(Counter(P + name, doc, labels, registry=r))

        def histogram(name: str, doc: str, labels: list[str]) -> Children:
            return Children(Histogram(P + name, doc, labels, buckets=LATENCY_BUCKETS,
                                      registry=r))

        self.requests = counter("requests", "Requests answered, by route, worker and HTTP "
                                "status.", ["route", "worker", "status"])
        self.errors = counter("errors", "Failed upstream attempts and refusals, by route, "
                              "worker and kind.", ["route", "worker", "kind"])
        self.latency = histogram("request_latency_seconds", "Request latency (arrival to last "
                                 "byte), by route and worker.", ["route", "worker"])
        self.ttfb = histogram("time_to_first_byte_seconds", "Arrival to the first byte sent "
                              "to the client.", ["route"])
        self.overhead = Histogram(f"{P}router_overhead_seconds", "Time the router itself adds "
                                  "before dispatch: guards, admission (queue wait excluded), "
                                  "policy.", buckets=OVERHEAD_BUCKETS, registry=r)
        self.queue_wait = Histogram(f"{P}queue_wait_seconds", "Time spent in the router's "
                                    "queue.", buckets=LATENCY_BUCKETS, registry=r)
        self.decisions = counter("routing_decisions", "Routing decisions by policy and "
                                 "reason.", ["policy", "reason"])
        self.predicted_hit = counter("predicted_prefix_hit_tokens", "Prompt tokens the policy "
                                     "predicted cached on the chosen worker.", ["worker"])
        self.routed_prompt = counter("routed_prompt_tokens", "Estimated prompt tokens routed.",
                                     ["worker"])
        self.retries = counter("retries", "Attempts retried on another worker, by reason.",
                               ["route", "reason"])
        self.rejected = counter("rejected", "Requests refused by the router itself, by "
                                "reason.", ["reason"])
        self.transitions = counter("breaker_transitions", "Circuit breaker transitions.",
                                   ["worker", "from_state", "to_state"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens (from usage).", ["model"])
        self.generation_tokens = counter("generation_tokens", "Generated tokens (from usage).",
                                         ["model"])
        self._gauges()

    def _gauges(self) -> None:
        r = self.registry
        self.worker_healthy = Gauge(f"{P}worker_healthy", "1 when the worker passes its "
                                    "health checks.", ["worker"], registry=r)
        self.worker_outstanding = Gauge(f"{P}worker_outstanding_requests", "Requests in "
                                        "flight to the worker.", ["worker"], registry=r)
        self.worker_waiting = Gauge(f"{P}worker_waiting_requests", "The worker's own queue "
                                    "(heron:num_requests_waiting).", ["worker"], registry=r)
        self.breaker_state = Gauge(f"{P}breaker_state", "0 closed, 1 open, 2 half-open.",
                                   ["worker"], registry=r)
        self.reported_hit_rate = Gauge(f"{P}worker_prefix_cache_hit_rate", "The worker's "
                                       "reported prefix-cache hit rate (hits / queries).",
                                       ["worker"], registry=r)
        self.predicted_hit_rate = Gauge(f"{P}predicted_prefix_hit_rate", "Predicted hit "
                                        "tokens / routed prompt tokens, all workers.",
                                        registry=r)
        self.cluster_hit_rate = Gauge(f"{P}reported_prefix_hit_rate", "The workers' reported "
                                      "prefix-cache hits / queries, all workers.", registry=r)
        self.cost = Gauge(f"{P}cost_per_million_tokens_dollars", "Blended cost per million "
                          "tokens since start (--cost-per-gpu-hour x workers).", registry=r)

    def record_transition(self, url: str, old: str, new: str) -> None:
        self.transitions.labels(url, old, new).inc()

    def record_usage(self, model: str, usage: dict) -> None:
        """Tokens in/out of one response's ``usage`` object."""
        model = model or "unknown"
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            self.prompt_tokens.labels(model).inc(prompt)
        if isinstance(completion, int):
            self.generation_tokens.labels(model).inc(completion)

    def _refresh(self) -> None:
        hits = queries = 0.0
        self.worker_healthy.clear(), self.worker_outstanding.clear()
        self.worker_waiting.clear(), self.breaker_state.clear(), self.reported_hit_rate.clear()
        for w in self.workers.all():
            self.worker_healthy.labels(w.url).set(1 if w.healthy else 0)
            self.worker_outstanding.labels(w.url).set(w.outstanding_requests)
            self.worker_waiting.labels(w.url).set(w.waiting_requests)
            self.breaker_state.labels(w.url).set(STATE_VALUES[w.breaker.state])
            if w.reported_hit_rate is not None:
                self.reported_hit_rate.labels(w.url).set(w.reported_hit_rate)
            hits, queries = hits + w.prefix_cache_hits, queries + w.prefix_cache_queries
        self.cluster_hit_rate.set(hits / queries if queries else 0.0)
        predicted = sum(s.value for m in self.predicted_hit.collect() for s in m.samples
                        if s.name.endswith("_total"))
        routed = sum(s.value for m in self.routed_prompt.collect() for s in m.samples
                     if s.name.endswith("_total"))
        self.predicted_hit_rate.set(predicted / routed if routed else 0.0)
        self._refresh_cost()

    def _refresh_cost(self) -> None:
        if not self.cost_per_gpu_hour:
            return
        tokens = sum(s.value for c in (self.prompt_tokens, self.generation_tokens)
                     for m in c.collect() for s in m.samples if s.name.endswith("_total"))
        if tokens:
            elapsed_h = (time.monotonic() - self._started) / 3600
            dollars = self.cost_per_gpu_hour * max(1, len(self.workers)) * elapsed_h
            self.cost.set(dollars / tokens * 1e6)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        self._refresh()
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class UsageScanner:
    """Finds the last ``usage`` object in an SSE stream without parsing every event: only
    lines that mention ``"usage": {`` are decoded."""

    def __init__(self) -> None:
        self.usage: dict | None = None
        self._carry = b""

    def feed(self, chunk: bytes) -> None:
        data = self._carry + chunk
        cut = data.rfind(b"\n")
        self._carry = data[cut + 1:] if cut >= 0 else data
        if len(self._carry) > 65536:  # no newline for that long: not worth keeping
            self._carry = b""
        if cut < 0 or b'"usage"' not in data[:cut]:
            return
        for line in data[:cut].splitlines():
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = usage_of(line[6:])
                if usage is not None:
                    self.usage = usage
