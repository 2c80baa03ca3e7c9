"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ``max_n`` down to ``min_n``). Free to run, and strong when
the output copies its context (editing code, quoting a passage, summaries)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from heron.speculative.interface import BatchState, StepView


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


class NgramProposer:
    """Prompt lookup over each proposing sequence's tokens in the batch state."""

    catches_up = False  # keeps no state of its own
    tree = None  # one chain

    def __init__(self, batch: BatchState, min_n: int, max_n: int, max_model_len: int) -> None:
        self.batch, self.min_n, self.max_n = batch, min_n, max_n
        self.max_model_len = max_model_len

    def propose(self, view: StepView) -> dict[str, list[int]]:
        batch, out = self.batch, {}
        for i in view.proposing:
            seq = view.seqs[i]
            length = int(batch.num_tokens[seq.row])
            k = min(view.num_spec, self.max_model_len - length - 1)
            if k > 0:
                drafts = propose_ngram(batch.token_ids[seq.row, :length], k, self.min_n,
                                       self.max_n)
                if drafts:
                    out[seq.req_id] = drafts
        return out
