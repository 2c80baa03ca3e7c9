"""Turns per-sequence progress into ``RequestOutput``s: detokenization, stop strings, n > 1."""

from __future__ import annotations

from dataclasses import dataclass, field

from heron.engine.detokenizer import IncrementalDetokenizer
from heron.engine.request import Request
from heron.outputs import CompletionOutput, RequestOutput


@dataclass
class RequestGroup:
    """The n sequences sampled for one user request, and their detokenizers (if a tokenizer)."""

    request_id: str
    prompt: str | None
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    num_emitted_tokens: list[int] = field(default_factory=list)
    error: str | None = None  # set when processing failed: every child ends with "error"

    def __post_init__(self) -> None:
        self.num_emitted_tokens = [0] * len(self.children)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    def update_text(self, child_index: int) -> str | None:
        """Feed new tokens of one child to its detokenizer; returns a stop string hit."""
        detok = self.detokenizers[child_index]
        child = self.children[child_index]
        new = child.output_token_ids[self.num_emitted_tokens[child_index]:]
        self.num_emitted_tokens[child_index] = child.num_output_tokens
        if detok is None or not new:
            return None
        hit = detok.update(new)
        if child.is_finished and hit is None:
            detok.flush()
        return hit

    def to_output(self) -> RequestOutput:
        first = self.children[0]
        outputs = []
        for i, (child, detok) in enumerate(zip(self.children, self.detokenizers)):
            outputs.append(CompletionOutput(
                index=i,
                text=detok.text if detok else "",
                token_ids=list(child.output_token_ids),
                logprobs=list(child.logprobs) if child.params.logprobs is not None else None,
                finish_reason=child.status.value if child.is_finished else None,
                stop_reason=child.stop_reason,
            ))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=(list(first.prompt_logprobs)
                             if first.params.prompt_logprobs is not None else None),
            metrics=_metrics(self.children),
            num_cached_tokens=first.num_cached_tokens or 0,
            error=self.error,
        )


def _metrics(children: list[Request]) -> dict:
    first = children[0]
    return {
        "arrival_time": first.arrival_time,
        "scheduled_time": min((c.scheduled_time for c in children if c.scheduled_time),
                              default=None),
        "first_token_time": min((c.first_token_time for c in children if c.first_token_time),
                                default=None),
        "finish_time": max((c.finish_time for c in children if c.finish_time), default=None),
        "num_preemptions": sum(c.num_preemptions for c in children),
    }
