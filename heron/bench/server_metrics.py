"""Scrape a server's Prometheus ``/metrics`` before and after a run, and diff the two.

Only samples whose name matches a pattern are kept (by default KV-cache usage, preemptions,
prefix-cache hits and queue depth, under whatever prefix the server uses: ``heron:``,
``vllm:``, ``llamacpp:``). Histogram buckets are dropped. A server without /metrics (or
without ``prometheus_client`` installed here) yields None, never an error.
"""

from __future__ import annotations

import re

DEFAULT_PATTERN = r"kv_cache|preempt|prefix|cache_hit|num_requests|requests_(running|waiting)"


def parse(text: str, pattern: str = DEFAULT_PATTERN) -> dict[str, float]:
    """Prometheus text -> {'name{label="v"}': value} for matching samples."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted, out = re.compile(pattern), {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")) or not wanted.search(s.name):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


async def scrape(client, root: str, headers: dict, pattern: str = DEFAULT_PATTERN
                 ) -> dict[str, float] | None:
    """GET root/metrics and parse it; None if that is not possible."""
    try:
        resp = await client.get(root + "/metrics", headers=headers, timeout=10)
        if resp.status_code != 200:
            return None
        return parse(resp.text, pattern)
    except Exception:  # noqa: BLE001 - no server metrics is not a benchmark failure
        return None


def diff(before: dict | None, after: dict | None) -> dict | None:
    """{sample: {"before", "after", "delta"}} over the samples seen after the run."""
    if after is None:
        return None
    before = before or {}
    return {k: {"before": before.get(k), "after": v,
                "delta": v - before[k] if k in before else None} for k, v in after.items()}
