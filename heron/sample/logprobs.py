"""The logprobs reported for one position: the chosen token's, and the top k."""

from __future__ import annotations

import torch

from heron.outputs import PositionLogprobs


def top_logprobs(logprobs: torch.Tensor, token_ids: int | torch.Tensor,
                 k: int) -> PositionLogprobs:
    """logprobs (V,) of one position -> {token: (logprob, rank)} for the chosen token and top-k."""
    chosen = int(token_ids)
    chosen_lp = logprobs[chosen]
    result = {chosen: (float(chosen_lp), int((logprobs > chosen_lp).sum()) + 1)}
    if k > 0:
        values, ids = logprobs.topk(k)
        for rank, (lp, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            result.setdefault(tid, (lp, rank))
    return result
