"""POST /tokenize and POST /detokenize (vLLM's shapes), tokenizers run off the event loop."""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from pydantic import Field, model_validator

from heron.server.errors import RequestValidationError
from heron.server.openapi import error_responses, json_body
from heron.server.protocol import (ChatCompletionRequest, ChatMessage, StrictModel, TokenId,
                                   parse_request)
from heron.server.serving_chat import apply_template


class TokenizeRequest(StrictModel):
    """Either ``prompt`` (text) or ``messages`` (through the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' (a string) or 'messages'")
        return self


class TokenizeResponse(StrictModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(StrictModel):
    model: Optional[str] = None
    tokens: list[TokenId]


class DetokenizeResponse(StrictModel):
    prompt: str


def _tokenize(tokenizer, req: TokenizeRequest, template: str | None = None) -> list[int]:
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages,
                                     add_generation_prompt=req.add_generation_prompt)
        return apply_template(tokenizer, chat, template)
    return tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids


def install_tokenizer_routes(app: FastAPI, state) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse,
              responses=error_responses(400, 401, 404, 408, 413, 415, 503),
              openapi_extra=json_body(TokenizeRequest))
    async def tokenize(request: Request):
        req = parse_request(TokenizeRequest, await request.body())
        state.check_model(req.model)
        ids = await state.run_blocking(_tokenize, state.client.tokenizer, req,
                                       state.settings.openai.chat_template)
        return TokenizeResponse(tokens=ids, count=len(ids),
                                max_model_len=state.client.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse,
              responses=error_responses(400, 401, 404, 408, 413, 415, 503),
              openapi_extra=json_body(DetokenizeRequest))
    async def detokenize(request: Request):
        req = parse_request(DetokenizeRequest, await request.body())
        state.check_model(req.model)
        vocab = state.client.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise RequestValidationError(f"token ids must be in [0, {vocab})", "tokens")
        text = await state.run_blocking(state.client.tokenizer.decode, req.tokens)
        return DetokenizeResponse(prompt=text)
