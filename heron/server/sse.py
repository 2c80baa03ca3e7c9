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
    """Per completion key, what a streaming client has been sent, for delta outputs: whether
    the completion has been seen, how much text went out (for text offsets), the tokens that
    came without text (held back: a stop string may begin there), and the tokens sent in all.
    Every call costs O(its delta): nothing is re-read or diffed."""

    seen: set = field(default_factory=set)
    text_sent: dict = field(default_factory=dict)
    held: dict = field(default_factory=dict)  # key -> (token ids, logprobs or None)
    completion_tokens: int = 0

    def is_new(self, key) -> bool:
        """True the first time ``key`` is asked about."""
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def take(self, key, comp: CompletionOutput) -> tuple[str, list, list | None, int] | None:
        """For delta ``comp``: (text, token ids, logprobs, text offset) to send now, or None
        while it brings no text and no finish (its tokens then go out with the next chunk)."""
        self.completion_tokens += len(comp.token_ids)
        ids, logprobs = comp.token_ids, comp.logprobs
        if (held := self.held.pop(key, None)) is not None:
            ids, logprobs = held
            ids.extend(comp.token_ids)
            if logprobs is not None and comp.logprobs is not None:
                logprobs.extend(comp.logprobs)
        if not comp.text and comp.finish_reason is None:
            if held is None:  # our own lists: the delta's are not ours to extend
                ids, logprobs = list(ids), (list(logprobs) if logprobs is not None else None)
            self.held[key] = ids, logprobs
            return None
        offset = self.text_sent.get(key, 0)
        self.text_sent[key] = offset + len(comp.text)
        return comp.text, ids, logprobs, offset
