"""What the engine core emits per step: for each sequence that progressed, only what is new.

The core never builds cumulative outputs: a ``SequenceDelta`` carries the tokens (and their
logprobs) a sequence gained this step, plus its finish once. Text, stop strings and n > 1
grouping happen downstream (``output_processor.OutputProcessor``), in the offline engine or in
the API process. Plain msgspec data, so the same object crosses the process boundary.
"""

from __future__ import annotations

import enum

import msgspec

# One position's logprobs on the wire: [(token_id, logprob, rank), ...].
WireLogprobs = list[tuple[int, float, int]]


class RequestOutputKind(enum.Enum):
    """What a consumer of ``RequestOutput``s is given for a request."""

    CUMULATIVE = "cumulative"  # everything so far, each time (copies: O(length) per output)
    DELTA = "delta"  # only what is new since the previous output (O(1) per token)
    FINAL_ONLY = "final_only"  # one output, when the request finishes


class SequenceDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What is new for one sequence (completion ``index`` of request ``request_id``)."""

    request_id: str  # the user-facing request
    index: int  # completion index, 0 <= index < n
    new_token_ids: list[int]
    new_logprobs: list[WireLogprobs] | None = None  # one entry per new token, if requested
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it (stop strings: downstream)
    error: str | None = None  # with finish_reason "error": why the engine failed it
    # on a sequence's first delta only (the step that sampled its first token, or its finish)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[WireLogprobs | None] | None = None  # index 0 only, when asked for
    arrival_time: float | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def encode_logprobs(position: dict[int, tuple[float, int]] | None) -> WireLogprobs | None:
    if position is None:
        return None
    return [(token, lp, rank) for token, (lp, rank) in position.items()]


def decode_logprobs(wire: WireLogprobs | None) -> dict[int, tuple[float, int]] | None:
    if wire is None:
        return None
    return {token: (lp, rank) for token, lp, rank in wire}
