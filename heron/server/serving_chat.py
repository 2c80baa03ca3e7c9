"""POST /v1/chat/completions: messages through the chat template, n, logprobs, streaming."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from heron.server.errors import RequestValidationError
from heron.server.logprobs_format import chat_logprobs
from heron.server.protocol import ChatCompletionRequest
from heron.server.responses import (ChatChoiceLogprobs, ChatCompletionChoice,
                                    ChatCompletionResponse, ChatCompletionStreamChoice,
                                    ChatCompletionStreamResponse, ChatResponseMessage,
                                    DeltaMessage, Usage, random_id)
from heron.server.request_runner import (check_request, run_all_to_completion,
                                         stream_outputs)
from heron.server.sse import StreamCursor, sse_done, sse_event, with_error_event


def apply_template(tokenizer, req: ChatCompletionRequest,
                   template: str | None = None) -> list[int]:
    """The prompt's token ids: the messages through ``template`` (``--chat-template``) or
    else the tokenizer's own."""
    if not template and not getattr(tokenizer, "chat_template", None):
        raise RequestValidationError("this model has no chat template: start the server with "
                                     "--chat-template", "messages")
    try:
        ids = tokenizer.apply_chat_template(req.conversation(), tokenize=True,
                                            add_generation_prompt=req.add_generation_prompt,
                                            chat_template=template)
    except Exception as e:  # template errors (e.g. role order) are the client's to fix
        raise RequestValidationError(f"chat template failed: {e}", "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def response_role(req: ChatCompletionRequest, options) -> str:
    """vLLM's rule: ``--response-role`` when the prompt asks the model for a new turn
    (``add_generation_prompt``), else the role of the message being continued."""
    if req.add_generation_prompt:
        return options.response_role
    return req.messages[-1].role


async def create_chat_completion(req: ChatCompletionRequest, http_request: Request, state):
    tokenizer, options = state.client.tokenizer, state.settings.openai
    params = req.to_sampling_params(None, options.sampling_defaults, options.max_logprobs)
    prompt = await state.run_blocking(apply_template, tokenizer, req, options.chat_template)
    check_request(state, [prompt], params)
    admission = state.admit(len(prompt) * params.n, params.n)
    request_id = random_id("chatcmpl")
    outputs = stream_outputs(state, request_id, prompt, params, req.cache_salt)
    if req.stream:
        events = _stream(req, state, request_id, prompt, outputs, admission)
        return StreamingResponse(with_error_event(events), media_type="text/event-stream")
    try:
        finals = await run_all_to_completion(http_request, [outputs])
    finally:
        admission.release()
    if finals is None:
        return JSONResponse({}, status_code=499)
    final = finals[0]
    k, as_ids = req.top_logprobs or 0, options.return_tokens_as_token_ids
    choices = [ChatCompletionChoice(
        index=c.index, message=ChatResponseMessage(role=response_role(req, options),
                                                   content=c.text),
        logprobs=ChatChoiceLogprobs(
            content=chat_logprobs(tokenizer, c.token_ids, c.logprobs or [], k, as_ids))
        if req.logprobs else None,
        finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in final.outputs]
    usage = Usage.of(len(prompt), sum(len(c.token_ids) for c in final.outputs),
                     final.num_cached_tokens)
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=usage)


async def _stream(req, state, request_id, prompt, outputs, admission):
    tokenizer, options = state.client.tokenizer, state.settings.openai
    k, role = req.top_logprobs or 0, response_role(req, state.settings.openai)
    cursor = StreamCursor()
    cached_tokens = 0

    def chunk(choice):
        return sse_event(ChatCompletionStreamResponse(id=request_id, model=state.model_name,
                                                      choices=[choice]))

    try:
        async for out in outputs:
            cached_tokens = out.num_cached_tokens
            for c in out.outputs:
                if cursor.is_new(c.index):
                    yield chunk(ChatCompletionStreamChoice(
                        index=c.index, delta=DeltaMessage(role=role, content="")))
                if (new := cursor.take(c.index, c)) is None:
                    continue
                text, token_ids, positions, _ = new
                logprobs = None
                if req.logprobs:
                    logprobs = ChatChoiceLogprobs(content=chat_logprobs(
                        tokenizer, token_ids, positions or [], k,
                        options.return_tokens_as_token_ids))
                yield chunk(ChatCompletionStreamChoice(
                    index=c.index, delta=DeltaMessage(content=text),
                    logprobs=logprobs, finish_reason=c.finish_reason))
        if req.include_usage:
            yield sse_event(ChatCompletionStreamResponse(
                id=request_id, model=state.model_name, choices=[],
                usage=Usage.of(len(prompt), cursor.completion_tokens, cached_tokens)))
        yield sse_done()
    finally:
        await outputs.aclose()
        admission.release()
