"""Cost & efficiency arithmetic: tokens/s per GPU, $ per million tokens, SLO capacity.

Cost model. A deployment of ``num_gpus`` GPUs at ``price`` $/GPU-hour that processes ``I``
input and ``O`` output tokens/s costs ``num_gpus x price / 3600`` $/s. That cost is split
between input and output tokens by the share of time spent on each: prefill runs at a rate
``P`` tokens/s (measured by `bench latency`), so input tokens take ``I / P`` of every second
and output tokens the rest. Without a prefill rate the cost is blended (every token costs the
same). GPU-seconds per token, times the token mix of a request, give the GPUs a target
request rate needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_PREFILL_SHARE = 0.99  # a measured I / P at or above 1 means P was under-measured


@dataclass(frozen=True)
class TokenTime:
    """GPU-seconds per input and per output token at one operating point."""

    input_s: float
    output_s: float
    method: str  # "prefill share" or "blended"


def token_time(in_tok_s: float, out_tok_s: float, num_gpus: int = 1,
               prefill_tok_s: float | None = None) -> TokenTime:
    """Split the deployment's GPU time between input and output tokens (see module doc)."""
    if out_tok_s <= 0 or in_tok_s < 0 or num_gpus < 1:
        raise ValueError("need output tokens/s > 0, input tokens/s >= 0 and num_gpus >= 1")
    if prefill_tok_s is None or in_tok_s == 0:
        per_token = num_gpus / (in_tok_s + out_tok_s)
        return TokenTime(per_token, per_token, "blended")
    if prefill_tok_s <= 0:
        raise ValueError(f"prefill tokens/s must be > 0, got {prefill_tok_s}")
    share_in = min(in_tok_s / prefill_tok_s, MAX_PREFILL_SHARE)
    return TokenTime(num_gpus * share_in / in_tok_s, num_gpus * (1 - share_in) / out_tok_s,
                     "prefill share")


def usd_per_million(gpu_seconds_per_token: float, gpu_hour_price: float) -> float:
    """$ per million tokens at ``gpu_hour_price`` $/GPU-hour."""
    if gpu_hour_price < 0:
        raise ValueError(f"--gpu-hour-price must be >= 0, got {gpu_hour_price}")
    return gpu_seconds_per_token * gpu_hour_price / 3600 * 1e6


def efficiency(in_tok_s: float, out_tok_s: float, num_gpus: int = 1,
               gpu_hour_price: float | None = None, prefill_tok_s: float | None = None) -> dict:
    """Tokens/s per GPU and, with a price, $ per million input / output / all tokens."""
    t = token_time(in_tok_s, out_tok_s, num_gpus, prefill_tok_s)
    out = {"tok_s_per_gpu": (in_tok_s + out_tok_s) / num_gpus,
           "output_tok_s_per_gpu": out_tok_s / num_gpus, "split": t.method,
           "usd_per_m_input": None, "usd_per_m_output": None, "usd_per_m_blended": None}
    if gpu_hour_price is not None:
        out |= {"usd_per_m_input": usd_per_million(t.input_s, gpu_hour_price),
                "usd_per_m_output": usd_per_million(t.output_s, gpu_hour_price),
                "usd_per_m_blended": usd_per_million(num_gpus / (in_tok_s + out_tok_s),
                                                     gpu_hour_price)}
    return out


def highest_passing(rows: list[dict], attainment: float) -> dict | None:
    """The row with the highest offered rate whose ``slo_attainment`` >= ``attainment``
    (an 'inf' rate counts as the highest); None if no row passes."""
    if not 0 < attainment <= 1:
        raise ValueError(f"SLO attainment target must be in (0, 1], got {attainment}")
    passing = [r for r in rows if (r.get("slo_attainment") or 0) >= attainment]
    return max(passing, key=lambda r: float(r["request_rate"]), default=None)


def gpus_needed(target_rate: float, input_len: float, output_len: float, t: TokenTime) -> int:
    """GPUs to serve ``target_rate`` req/s of the given token mix at the operating point
    ``t`` was measured at (at least 1)."""
    if target_rate <= 0 or input_len < 0 or output_len < 0:
        raise ValueError("need a target rate > 0 and token lengths >= 0")
    demand = target_rate * (input_len * t.input_s + output_len * t.output_s)
    return max(1, math.ceil(demand - 1e-9))
