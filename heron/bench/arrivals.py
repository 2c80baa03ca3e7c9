"""Request send times: Poisson, constant-rate, or gamma (bursty) arrivals.

All processes have mean rate ``rate`` req/s; the first request goes at t=0. Gamma gaps with
shape ``burstiness`` (scale 1 / (rate * burstiness)) give Poisson at 1, burstier traffic
below 1 and more regular traffic above 1. ``rate = inf`` sends everything at t=0.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

PROCESSES = ("poisson", "constant", "gamma")


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]; every rate must be > 0."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"bad request rate {part!r}: use numbers (req/s) or inf") from None
        if not rate > 0:
            raise ValueError(f"request rates must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates


def send_times(num: int, rate: float, process: str = "poisson", burstiness: float = 1.0,
               seed: int = 0) -> list[float]:
    """``num`` non-decreasing send offsets in seconds, starting at 0."""
    if process not in PROCESSES:
        raise ValueError(f"arrival process must be one of {PROCESSES}, got {process!r}")
    if num < 0 or not rate > 0 or not burstiness > 0:
        raise ValueError("need num >= 0, rate > 0 and burstiness > 0")
    if num == 0:
        return []
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    if process == "constant":
        gaps = np.full(num - 1, 1.0 / rate)
    elif process == "poisson":
        gaps = rng.exponential(1.0 / rate, num - 1)
    else:
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), num - 1)
    return list(itertools.accumulate(gaps.tolist(), initial=0.0))
