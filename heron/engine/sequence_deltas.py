"""Build a sequence's ``SequenceDelta`` from its ``Request``: only what is new, O(new)."""

from __future__ import annotations

from heron.engine.core_outputs import SequenceDelta, encode_logprobs
from heron.engine.request import Request


def sequence_delta(request: Request, new_token_ids: list[int], new_logprobs=None,
                   error: str | None = None) -> SequenceDelta:
    """The tokens ``request`` gained (and its finish, if it finished). The first delta of a
    sequence also carries its prompt facts; metric times ride on every delta (cheap)."""
    delta = SequenceDelta(
        request.parent_id, request.index, list(new_token_ids),
        [encode_logprobs(p) for p in new_logprobs] if new_logprobs is not None else None,
        finish_reason=request.status.value if request.is_finished else None,
        stop_reason=request.stop_reason if isinstance(request.stop_reason, int) else None,
        error=error, arrival_time=request.arrival_time, scheduled_time=request.scheduled_time,
        first_token_time=request.first_token_time, finish_time=request.finish_time,
        num_preemptions=request.num_preemptions)
    request.final_delta_sent = request.is_finished
    if not request.first_delta_sent:
        request.first_delta_sent = True
        delta.num_prompt_tokens = request.num_prompt_tokens
        delta.num_cached_tokens = request.num_cached_tokens or 0
        if request.params.prompt_logprobs is not None and request.index == 0:
            delta.prompt_logprobs = [encode_logprobs(p) for p in request.prompt_logprobs]
    return delta
