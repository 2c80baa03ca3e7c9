"""Runs one admitted request against the engine client: tokens in, delta RequestOutputs out
(folded into final ones for non-streaming answers), with per-request metrics (however the
request ends) and abort on client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from heron.engine.core_outputs import RequestOutputKind
from heron.engine.prompt_rules import PromptError, check_prompt
from heron.outputs import OutputAccumulator, RequestOutput
from heron.sampling_params import SamplingParams
from heron.server.errors import RequestValidationError
from heron.errors import EngineDeadError, RequestFailedError

DISCONNECT_POLL_S = 0.25
logger = logging.getLogger("heron.server.requests")


def check_request(state, prompts: list[list[int]], params: SamplingParams) -> None:
    """Everything the engine would refuse, refused here first (HTTP 400): the engine's prompt
    rules (``check_prompt``), prompt + max_tokens beyond the context (the engine would cut
    the completion short; OpenAI's API refuses it), more sequences (prompts x n) than one
    request may have."""
    limit = state.settings.max_sequences_per_request
    if len(prompts) * params.n > limit:
        raise RequestValidationError(
            f"{len(prompts)} prompts x n={params.n} is {len(prompts) * params.n} sequences; "
            f"at most {limit} are allowed per request", "n" if len(prompts) == 1 else "prompt")
    max_model_len = state.client.max_model_len
    for ids in prompts:
        try:
            room = check_prompt(ids, params, max_model_len, state.client.vocab_size)
        except PromptError as exc:
            raise RequestValidationError(str(exc), exc.param) from None
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestValidationError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context of {max_model_len} tokens", "max_tokens")


@dataclass
class _Tally:
    """What one request's metrics need, gathered from its delta outputs in O(1) each."""

    started: float = field(default_factory=time.monotonic)  # if the engine never said
    completion_tokens: int = 0
    finish_reason: str | None = None  # of completion 0
    token_times: list[float] = field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_times.append(time.monotonic())
        self.last = out
        for comp in out.outputs:
            self.completion_tokens += len(comp.token_ids)
            if comp.index == 0 and comp.finish_reason is not None:
                self.finish_reason = comp.finish_reason


async def stream_outputs(state, request_id: str, prompt_ids: list[int], params: SamplingParams,
                         cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
    """Yield delta outputs (``RequestOutputKind.DELTA``). However the request ends, it is
    counted in the metrics and logged once: finished by the engine (its finish reason),
    left by its client or cut by the server (``"abort"``), or failed (``"error"``). Only a
    request the engine refused (ValueError: it never ran) is not."""
    tally = _Tally()
    ended = "abort"  # unless it finishes, fails or is refused below
    gen = state.client.generate(request_id, prompt_ids, params, cache_salt,
                                output_kind=RequestOutputKind.DELTA)
    try:
        # aclosing: closing this generator must close the engine stream now (-> abort), not
        # at GC
        async with contextlib.aclosing(gen):
            async for out in gen:
                tally.add(out)
                yield out
        ended = None
    except ValueError:
        ended = "refused"
        raise
    except (RequestFailedError, EngineDeadError):
        ended = "error"
        raise
    finally:  # also on GeneratorExit / CancelledError: the client left
        if ended != "refused":
            _observe(state.metrics, request_id, len(prompt_ids), tally,
                     tally.finish_reason or ended or "abort")


def _observe(metrics, request_id: str, prompt_tokens: int, tally: _Tally, reason: str) -> None:
    """Feed the Prometheus metrics and write the one log line per ended request."""
    out, token_times = tally.last, tally.token_times
    m = out.metrics if out is not None else {}
    completion = tally.completion_tokens
    now = time.monotonic()
    arrival = m.get("arrival_time") or tally.started
    first = m.get("first_token_time") or (token_times[0] if token_times else None)
    finish = m.get("finish_time") or now
    scheduled = m.get("scheduled_time")
    metrics.observe_request_finished(
        prompt_tokens=prompt_tokens, completion_tokens=completion, arrival=arrival,
        first_token=first, finish=finish, finish_reason=reason, token_times=token_times,
        queue_time=scheduled - arrival if scheduled is not None else None)
    tpot = (finish - first) / (completion - 1) if first is not None and completion > 1 else 0.0
    ttft = f"{first - arrival:.3f}s" if first is not None else "-"
    logger.info("request %s done: prompt=%d cached=%d output=%d ttft=%s tpot=%.4fs "
                "finish=%s", request_id, prompt_tokens,
                out.num_cached_tokens if out is not None else 0, completion, ttft, tpot, reason)


async def run_all_to_completion(http_request: Request,
                                streams: list[AsyncIterator[RequestOutput]]
                                ) -> list[RequestOutput] | None:
    """Drain every stream of delta outputs; their final cumulative outputs (each piece
    copied once, text joined once), or None (all aborted) if the HTTP client disconnects
    first. If one stream fails, the others are aborted and the error raised."""

    async def drain(outputs):
        acc = OutputAccumulator()
        async for out in outputs:
            acc.add(out)
        return acc.output(copy=False)

    tasks = [asyncio.ensure_future(drain(s)) for s in streams]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S,
                                               return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                raise failed[0].exception()
            if not pending:
                return [t.result() for t in tasks]
            if await http_request.is_disconnected():
                return None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()
