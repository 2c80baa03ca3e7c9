"""OpenAI-compatible request models (pydantic v2) and their mapping to SamplingParams.

Response bodies live in :mod:`heron.server.responses`.

Type errors are pydantic's (the app should turn them into 400s with
:func:`heron.server.errors.pydantic_error_message`); value limits raise
:class:`heron.server.errors.RequestValidationError` from :func:`validate_limits` and
``to_sampling_params``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from heron.sampling_params import (MAX_INT32, MAX_LOGPROBS, MAX_N, MAX_SEED, MIN_SEED,
                                   SamplingParams)
from heron.server.errors import RequestValidationError, pydantic_error_message

MAX_STOP_STRINGS = 16
# What an unset sampling field means (OpenAI's defaults) unless the model's generation config
# says otherwise (``--generation-config``: max_tokens is handled by to_sampling_params).
OPENAI_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                            "repetition_penalty": 1.0}
# What a request may ask for at most (the engine's limit); ``--max-logprobs`` lowers it per server
# (vLLM's rule: OpenAI's own caps are 5 for completions and 20 for chat).
MAX_COMPLETION_LOGPROBS = MAX_LOGPROBS
MAX_TOP_LOGPROBS = MAX_LOGPROBS
# Known OpenAI / vLLM fields heron does not implement: refused when set rather than silently
# ignored (values that ask for the default behaviour are accepted, see _asks_for_default).
UNSUPPORTED_FIELDS = ("logit_bias", "suffix", "tools", "functions", "tool_choice",
                      "function_call", "response_format", "best_of", "use_beam_search",
                      "length_penalty", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "guided_decoding_backend", "structured_outputs",
                      "logits_processors", "allowed_token_ids", "bad_words", "prompt_embeds",
                      "prompt_logprobs", "truncate_prompt_tokens", "audio", "modalities",
                      "prediction")

# Typed fields: strict JSON types (no "2" or true for an int, no 1.0 for an int), finite floats,
# integers within their real domain so nothing beyond 64 bits reaches the engine.
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[int, Field(ge=1, le=MAX_INT32)]
PromptType = Union[str, Annotated[list[str], Field(min_length=1)],
                   Annotated[list[TokenId], Field(min_length=1)],
                   Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                             Field(min_length=1)]]


class StrictModel(BaseModel):
    """Request bodies: strict types, no NaN / Infinity, unknown nested fields ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


def parse_request(cls: type[pydantic.BaseModel], body: bytes):
    """Validate a raw JSON body (jiter: lone surrogates, invalid UTF-8 and runaway nesting are
    JSON errors); any failure raises RequestValidationError (HTTP 400)."""
    try:
        return cls.model_validate_json(body)
    except pydantic.ValidationError as exc:
        message, param = pydantic_error_message(exc.errors(include_url=False))
        raise RequestValidationError(message, param) from None


def _prompt_items(prompt: Any) -> list[Union[str, list[int]]]:
    """One prompt (a string or token ids) becomes a batch of one; a batch stays a batch."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class StreamOptions(StrictModel):
    include_usage: bool = False


class StreamingKV(StrictModel):
    """heron's extension: StreamingLLM for this request (attention sinks + a window); a
    misspelt key is an error, not a silently whole-context request."""

    model_config = ConfigDict(extra="forbid")  # merged with StrictModel's
    sink_tokens: Annotated[int, Field(ge=0, le=MAX_INT32)] = 4
    window: Annotated[int, Field(ge=1, le=MAX_INT32)]


class _SamplingRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions (unknown fields are kept in
    ``model_extra`` and ignored unless listed in UNSUPPORTED_FIELDS)."""

    model_config = ConfigDict(extra="allow")  # merged with StrictModel's

    model: Optional[str] = None
    temperature: Optional[Annotated[float, Field(ge=0.0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    n: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = 1  # null means 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = None
    frequency_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = None
    user: Optional[str] = None
    # vLLM-style extras
    top_k: Optional[Annotated[int, Field(ge=-1, le=MAX_INT32)]] = None
    min_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0.0, le=2.0)]] = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT32)] = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: Optional[str] = None  # prefix-cache namespace: no sharing across salts
    streaming_kv: Optional[StreamingKV] = None  # heron: StreamingLLM (else --streaming-kv)

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, salt: Optional[str]) -> Optional[str]:
        if salt is not None and not salt:
            raise ValueError("cache_salt must be a non-empty string")
        return salt

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        """Whether a streaming response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: Optional[int], logprobs: Optional[int],
                prompt_logprobs: Optional[int] = None, defaults: Optional[dict] = None,
                max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        """Build SamplingParams: unset fields take ``defaults`` (the model's generation config,
        see ``generation_defaults``), then OpenAI's; ValueError -> 400."""
        validate_limits(self)
        _check(logprobs is None or logprobs <= max_logprobs,
               f"requested {logprobs} logprobs, more than this server's limit of "
               f"{max_logprobs} (--max-logprobs)", self._param_name("logprobs") or "logprobs")
        given = lambda name, default: (  # noqa: E731 - the request's value, else the default
            getattr(self, name) if getattr(self, name) is not None else default)
        values = {name: given(name, value)
                  for name, value in {**OPENAI_SAMPLING_DEFAULTS, **(defaults or {})}.items()
                  if name in OPENAI_SAMPLING_DEFAULTS}
        try:
            return SamplingParams(
                n=given("n", 1), **values,
                presence_penalty=given("presence_penalty", 0.0),
                frequency_penalty=given("frequency_penalty", 0.0), seed=self.seed,
                max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop_list,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                streaming_kv=None if self.streaming_kv is None else (
                    self.streaming_kv.sink_tokens, self.streaming_kv.window))
        except ValueError as exc:
            message = str(exc)
            field = message.split(" ", 1)[0]
            raise RequestValidationError(message, self._param_name(field)) from None

    def _param_name(self, field: str) -> Optional[str]:
        return field if field in type(self).model_fields else None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: PromptType
    max_tokens: Optional[Count] = 16
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)]] = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if any(len(p) == 0 for p in _prompt_items(v)):
            raise ValueError("the prompt must not be empty")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """The batch of prompts: each a string or a list of token ids."""
        return _prompt_items(self.prompt)

    def to_sampling_params(self, default_max_tokens: Optional[int],
                           defaults: Optional[dict] = None,
                           max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        """``max_tokens: null`` means default_max_tokens, unset the generation config's
        ``max_tokens`` (if ``defaults`` has one) or 16; ``echo`` with ``logprobs`` also asks
        for prompt logprobs."""
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if "max_tokens" not in self.model_fields_set and defaults and "max_tokens" in defaults:
            max_tokens = defaults["max_tokens"]
        prompt_logprobs = self.logprobs if self.echo else None
        return self._params(max_tokens, self.logprobs, prompt_logprobs, defaults, max_logprobs)


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Count] = None
    max_completion_tokens: Optional[Count] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        """Messages as ``[{"role", "content"}]`` for a chat template."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_sampling_params(self, default_max_tokens: Optional[int],
                           defaults: Optional[dict] = None,
                           max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        """``max_completion_tokens`` overrides ``max_tokens``; neither set: the generation
        config's ``max_tokens`` (in ``defaults``) or default_max_tokens. ``logprobs: true``
        with ``top_logprobs: k`` asks for the sampled token's logprob plus the top k."""
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = (defaults or {}).get("max_tokens", default_max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs, None, defaults, max_logprobs)

    def _param_name(self, field: str) -> Optional[str]:
        if field == "logprobs":
            return "top_logprobs"
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super()._param_name(field)


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise RequestValidationError(message, param)


def validate_limits(req: _SamplingRequest, max_stop_strings: int = MAX_STOP_STRINGS) -> None:
    """What the field types cannot say (their ranges are checked while parsing); raises
    RequestValidationError."""
    n_stop = len(req.stop_list)
    _check(n_stop <= max_stop_strings,
           f"at most {max_stop_strings} stop strings are allowed, got {n_stop}", "stop")
    _check(req.stream or req.stream_options is None,
           "stream_options is only allowed when stream is true", "stream_options")
    n = 1 if req.n is None else req.n
    for name, value in (req.model_extra or {}).items():
        _check(name not in UNSUPPORTED_FIELDS or _asks_for_default(name, value, n),
               f"{name} is not supported by this server", name)
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None:
        _check(req.logprobs, "logprobs must be true when top_logprobs is set", "logprobs")


def _asks_for_default(name: str, value: Any, n: int) -> bool:
    """Values of unsupported fields that request what heron does anyway: unset, empty,
    ``response_format: {"type": "text"}``, ``best_of`` equal to n, no beam search."""
    if value is None or value == [] or value == {} or value is False:
        return True
    if name == "response_format":
        return value == {"type": "text"}
    if name == "best_of":
        return type(value) is int and value == n
    if name == "tool_choice":
        return value == "none"
    if name == "length_penalty":  # only meaningful with beam search
        return value == 1
    return False
