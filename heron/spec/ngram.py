"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ``max_n`` down to ``min_n``). Free to run, and strong when
the output copies its context (editing code, quoting a passage, summaries)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """tokens (L,) int: the sequence so far. Up to ``k`` draft tokens (may be empty)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length - n - 1: every earlier occurrence of n tokens
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the token after the latest occurrence
            return tokens[start:start + k].tolist()
    return []
