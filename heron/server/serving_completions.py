"""POST /v1/completions: prompts in any OpenAI shape, n, echo, logprobs, streaming."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from heron.outputs import RequestOutput
from heron.server.logprobs_format import completion_logprobs
from heron.server.protocol import CompletionRequest
from heron.server.responses import (CompletionChoice, CompletionResponse,
                                    CompletionStreamResponse, Usage, random_id)
from heron.server.request_runner import (check_request, run_all_to_completion,
                                         stream_outputs)
from heron.server.sse import StreamCursor, sse_done, sse_event, with_error_event


def _token_ids(tokenizer, prompts) -> list[list[int]]:
    return [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompts]


async def create_completion(req: CompletionRequest, http_request: Request, state):
    tokenizer, options = state.client.tokenizer, state.settings.openai
    params = req.to_sampling_params(None, options.sampling_defaults, options.max_logprobs)
    prompts = await state.run_blocking(_token_ids, tokenizer, req.prompts())
    check_request(state, prompts, params)
    admission = state.admit(sum(len(p) for p in prompts) * params.n, len(prompts) * params.n)
    base_id = random_id("cmpl")
    streams = [stream_outputs(state, f"{base_id}-{i}", ids, params, req.cache_salt)
               for i, ids in enumerate(prompts)]
    if req.stream:
        events = _stream(req, state, base_id, prompts, params.n, streams, admission)
        return StreamingResponse(with_error_event(events), media_type="text/event-stream")
    try:
        finals = await run_all_to_completion(http_request, streams)
    finally:
        admission.release()
    if finals is None:
        return JSONResponse({}, status_code=499)  # client went away; nobody reads this
    as_ids = options.return_tokens_as_token_ids
    choices = [c for i, f in enumerate(finals)
               for c in _choices(req, tokenizer, i, params.n, f, as_ids)]
    usage = Usage.of(sum(len(p) for p in prompts),
                     sum(len(c.token_ids) for f in finals for c in f.outputs),
                     sum(f.num_cached_tokens for f in finals))
    return CompletionResponse(id=base_id, model=state.model_name, choices=choices, usage=usage)


def _choices(req: CompletionRequest, tokenizer, prompt_index: int, n: int, out: RequestOutput,
             as_token_ids: bool = False):
    prompt_text = tokenizer.decode(out.prompt_token_ids) if req.echo else ""
    for comp in out.outputs:
        logprobs = None
        if req.logprobs is not None:
            ids, positions = comp.token_ids, comp.logprobs or []
            if req.echo:
                ids = out.prompt_token_ids + ids
                positions = list(out.prompt_logprobs or []) + positions
            logprobs = completion_logprobs(tokenizer, ids, positions, req.logprobs,
                                           as_token_ids=as_token_ids)
        yield CompletionChoice(index=prompt_index * n + comp.index, text=prompt_text + comp.text,
                               logprobs=logprobs, finish_reason=comp.finish_reason,
                               stop_reason=comp.stop_reason)


async def _merge(streams: list[AsyncIterator[RequestOutput]]):
    """Interleave several output streams as (prompt index, output)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async with contextlib.aclosing(s):
                async for out in s:
                    await queue.put((i, out))
        except Exception as e:  # surfaced to the consumer below
            await queue.put((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each pump closes its stream


async def _stream(req, state, base_id, prompts, n, streams, admission):
    cursor = StreamCursor()
    cached_tokens: dict[int, int] = {}  # prompt index -> its prefix-cache hit
    try:
        async with contextlib.aclosing(_merge(streams)) as merged:
            async for i, out in merged:
                cached_tokens[i] = out.num_cached_tokens
                for chunk in _chunks(req, state, base_id, i, n, out, cursor):
                    yield chunk
        if req.include_usage:
            usage = Usage.of(sum(len(p) for p in prompts), cursor.completion_tokens,
                             sum(cached_tokens.values()))
            yield sse_event(CompletionStreamResponse(id=base_id, model=state.model_name,
                                                     choices=[], usage=usage))
        yield sse_done()
    finally:
        admission.release()


def _chunks(req, state, base_id, i, n, out, cursor: StreamCursor):
    """SSE events for delta ``out`` of prompt i (choice index i * n + completion index)."""
    tokenizer = state.client.tokenizer
    for comp in out.outputs:
        key = (i, comp.index)
        if cursor.is_new(key) and req.echo:
            yield sse_event(_chunk(base_id, state, i * n + comp.index,
                                   tokenizer.decode(out.prompt_token_ids), None))
        if (new := cursor.take(key, comp)) is None:
            continue
        text, token_ids, positions, offset = new
        logprobs = None
        if req.logprobs is not None:
            as_ids = state.settings.openai.return_tokens_as_token_ids
            logprobs = completion_logprobs(tokenizer, token_ids, positions or [], req.logprobs,
                                           offset, as_ids)
        yield sse_event(_chunk(base_id, state, i * n + comp.index, text,
                               comp.finish_reason, logprobs, comp.stop_reason))


def _chunk(base_id, state, index, text, finish_reason, logprobs=None, stop_reason=None):
    return CompletionStreamResponse(id=base_id, model=state.model_name, choices=[
        CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                         stop_reason=stop_reason)])
