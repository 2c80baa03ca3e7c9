"""Results returned by the engine and the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> (logprob, rank in the full vocabulary, 1-based).
PositionLogprobs = dict[int, tuple[float, int]]


@dataclass
class CompletionOutput:
    """One of the n sequences generated for a prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    # "stop" | "length" | "abort" | "error" (see RequestOutput.error) | None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything known about a request so far (final when ``finished``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # why the engine failed this request (finish_reason "error")
