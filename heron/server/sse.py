"""Server-sent events framing for OpenAI streaming responses."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from heron.outputs import CompletionOutput


def sse_event(payload: BaseModel) -> str:
    # exclude_none=False: OpenAI clients expect explicit nulls (finish_reason: null)
    return f"data: {payload.model_dump_json()}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


@dataclass
class StreamCursor:
    """What a streaming client has been sent, per completion key: text length, token count,
    and whether its final chunk went out (a finished completion is never sent again)."""

    text: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)
    done: set = field(default_factory=set)

    def is_new(self, key) -> bool:
        return key not in self.text and key not in self.done

    def advance(self, key, comp: CompletionOutput) -> tuple[str, int] | None:
        """(new text, index of the first new token) of ``comp``, or None if nothing to send."""
        if key in self.done:
            return None
        start, first_token = self.text.get(key, 0), self.tokens.get(key, 0)
        finished = comp.finish_reason is not None
        if len(comp.text) == start and not finished:
            self.text.setdefault(key, 0)
            return None
        self.text[key], self.tokens[key] = len(comp.text), len(comp.token_ids)
        if finished:
            self.done.add(key)
        return comp.text[start:], first_token

    @property
    def completion_tokens(self) -> int:
        """Tokens of the completions that have finished."""
        return sum(self.tokens[key] for key in self.done)
