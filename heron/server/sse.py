"""Server-sent events framing for OpenAI streaming responses."""

from __future__ import annotations

from pydantic import BaseModel


def sse_event(payload: BaseModel) -> str:
    # exclude_none=False: OpenAI clients expect explicit nulls (finish_reason: null)
    return f"data: {payload.model_dump_json()}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"
