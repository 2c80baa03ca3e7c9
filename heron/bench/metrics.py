"""Serving metrics from per-request timings: latency distributions, throughput, goodput.

All times are seconds; distributions are reported in milliseconds. A request's ``chunks`` are
the arrival times (relative to its send) of the stream chunks that carried output; a chunk may
hold several tokens (a detokenizer holding back a partial character, or a server that batches
its stream), so ITL is measured per chunk and TPOT per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    """What one benchmark request saw. ``status`` 0 means no HTTP response (timeout, reset)."""

    send: float = 0.0          # send time relative to the start of its run
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # send -> first output chunk
    e2e: float | None = None   # send -> end of the response
    chunks: list[float] = field(default_factory=list)
    retry_after: float | None = None  # seconds, from a 429's Retry-After header

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def itl(self) -> list[float]:
        return inter_chunk_latencies(self.chunks)

    @property
    def tpot(self) -> float | None:
        return time_per_output_token(self.ttft, self.e2e, self.output_tokens)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("send", "status", "error", "prompt_tokens",
                                           "output_tokens", "ttft", "e2e", "retry_after")}
        d["chunks"] = [round(t, 6) for t in self.chunks]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        return cls(**{k: d[k] for k in ("send", "status", "error", "prompt_tokens",
                                        "output_tokens", "ttft", "e2e", "chunks",
                                        "retry_after") if k in d})


def inter_chunk_latencies(chunk_times: list[float]) -> list[float]:
    """Gaps between consecutive chunk arrivals (n chunks -> n - 1 gaps); times must not
    decrease."""
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    if any(g < 0 for g in gaps):
        raise ValueError("chunk timestamps must be non-decreasing")
    return gaps


def time_per_output_token(ttft: float | None, e2e: float | None, output_tokens: int
                          ) -> float | None:
    """(e2e - TTFT) / (tokens - 1): the mean gap after the first token; None for < 2 tokens."""
    if ttft is None or e2e is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def distribution(values: list[float], scale: float = 1000.0) -> dict:
    """Mean and P50/P90/P99 (linear interpolation between order statistics) of ``values``
    times ``scale`` (default: seconds -> ms); None/NaN values are dropped; all None if empty."""
    xs = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if xs.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    xs = xs * scale
    out = {"mean": float(xs.mean())}
    out |= {f"p{p}": float(np.percentile(xs, p)) for p in PERCENTILES}
    return out


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; a request meets the SLO if it succeeded and is
    within every objective given (ITL: its worst gap). An empty SLO is met by every success."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> "SLO":
        """'ttft=500,tpot=50' (ms) -> SLO; ValueError naming the bad part otherwise."""
        if not text:
            return cls()
        values = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"bad SLO part {part!r}: use KEY=MS with KEY in {SLO_KEYS}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"bad SLO value in {part!r}: not a number of ms") from None
            if values[key] <= 0:
                raise ValueError(f"SLO {key} must be > 0 ms, got {value}")
        return cls(**values)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in SLO_KEYS if getattr(self, k) is not None}

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        measured = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e,
                    "itl": max(r.itl) if len(r.chunks) > 1 else None}
        for key, limit in self.as_dict().items():
            value = measured[key]
            if key in ("ttft", "e2e") and value is None:
                return False
            if value is not None and value * 1000.0 > limit:
                return False
        return True


def summarize(records: list[RequestRecord], duration: float, slo: SLO = SLO()) -> dict:
    """Counts, throughput, goodput and latency distributions of one run lasting ``duration``
    seconds (first scheduled send to last response). ``uptime`` is the share of requests that
    succeeded; ``slo_attainment`` the share (of all sent) that met ``slo``; ``goodput`` the
    rate of those."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration}")
    ok = [r for r in records if r.ok]
    n, n429 = len(records), sum(r.status == 429 for r in records)
    met = sum(slo.met_by(r) for r in records)
    in_tok, out_tok = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    retry = [r.retry_after for r in records if r.retry_after is not None]
    return {
        "num_requests": n, "completed": len(ok), "rejected_429": n429,
        "errors": n - len(ok) - n429, "uptime": len(ok) / n if n else None,
        "retry_after_max_s": max(retry) if retry else None,
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "input_token_throughput": in_tok / duration,
        "output_token_throughput": out_tok / duration,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "goodput": met / duration, "slo_attainment": met / n if n else None,
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([r.tpot for r in ok]),
        "itl_ms": distribution([g for r in ok for g in r.itl]),
        "e2e_ms": distribution([r.e2e for r in ok]),
        "error_samples": sorted({r.error[:120] for r in records
                                 if r.error and r.status != 429})[:3],
    }
