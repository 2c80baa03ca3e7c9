"""Server-sent events framing for OpenAI streaming responses."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

from pydantic import BaseModel

from heron.outputs import CompletionOutput
from heron.server.errors import error_body
from heron.server.failures import FAILURES, classify

logger = logging.getLogger("heron.server")


def sse_event(payload: BaseModel) -> str:
    # exclude_none=False: OpenAI clients expect explicit nulls (finish_reason: null)
    return f"data: {payload.model_dump_json()}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


def sse_error(status: int, message: str, type_: str) -> str:
    """An error event in OpenAI's shape: what a stream that cannot complete ends with."""
    return f"data: {json.dumps(error_body(message, type_, None, status))}\n\n"


async def with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass ``events`` through; if they fail, end with an error event (and no [DONE]), so a
    client never mistakes a broken stream for a finished one."""
    try:
        async with contextlib.aclosing(events):  # a client that leaves closes both now
            async for event in events:
                yield event
    except Exception as exc:  # noqa: BLE001 - the client must learn the stream broke
        if not isinstance(exc, FAILURES):
            logger.exception("stream failed")  # a bug of ours
        yield sse_error(*classify(exc))


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
