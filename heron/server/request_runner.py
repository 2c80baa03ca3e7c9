"""Runs one admitted request against the engine client: tokens in, RequestOutputs out,
with admission release, per-request metrics and abort on client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

from fastapi import Request

from heron.outputs import RequestOutput
from heron.sampling_params import SamplingParams
from heron.server.errors import RequestValidationError

DISCONNECT_POLL_S = 0.25
logger = logging.getLogger("heron.server.requests")


def check_length(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> None:
    """Prompt bombs and impossible budgets fail with 400 before any work."""
    if not prompt_ids:
        raise RequestValidationError("the prompt is empty", "prompt")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise RequestValidationError(
            f"the prompt has {len(prompt_ids)} tokens but this model's context is "
            f"{max_model_len} tokens", "prompt")
    if params.max_tokens is not None and params.max_tokens > room:
        raise RequestValidationError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the model's context of {max_model_len} tokens", "max_tokens")


async def stream_outputs(state, request_id: str, prompt_ids: list[int], params: SamplingParams,
                         cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
    """Yield cumulative outputs; record metrics once the request ends."""
    token_times: list[float] = []
    last = None
    gen = state.client.generate(request_id, prompt_ids, params, cache_salt)
    # aclosing: closing this generator must close the engine stream now (-> abort), not at GC
    async with contextlib.aclosing(gen):
        async for out in gen:
            token_times.append(time.monotonic())
            last = out
            yield out
    if last is not None:
        _observe(state.metrics, last, token_times)


def _observe(metrics, out: RequestOutput, token_times: list[float]) -> None:
    """Feed the Prometheus metrics and write the one log line per finished request."""
    m = out.metrics
    completion = sum(len(c.token_ids) for c in out.outputs)
    arrival = m.get("arrival_time") or token_times[0]
    first = m.get("first_token_time") or token_times[0]
    finish = m.get("finish_time") or token_times[-1]
    reason = out.outputs[0].finish_reason or "abort"
    scheduled = m.get("scheduled_time")
    metrics.observe_request_finished(
        prompt_tokens=len(out.prompt_token_ids), completion_tokens=completion, arrival=arrival,
        first_token=first, finish=finish, finish_reason=reason, token_times=token_times,
        queue_time=scheduled - arrival if scheduled is not None else None)
    tpot = (finish - first) / (completion - 1) if completion > 1 else 0.0
    logger.info("request %s done: prompt=%d cached=%d output=%d ttft=%.3fs tpot=%.4fs "
                "finish=%s", out.request_id, len(out.prompt_token_ids), out.num_cached_tokens,
                completion, first - arrival, tpot, reason)


async def run_to_completion(http_request: Request, outputs: AsyncIterator[RequestOutput]
                            ) -> RequestOutput | None:
    """Drain ``outputs``; returns None (and aborts) if the HTTP client disconnects first."""

    async def drain():
        final = None
        async for out in outputs:
            final = out
        return final

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http_request.is_disconnected():
                task.cancel()
                return None
    finally:
        if not task.done():
            task.cancel()
        await outputs.aclose()
