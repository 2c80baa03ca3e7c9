"""OpenAI-compatible request models (pydantic v2) and their mapping to SamplingParams.

Response bodies live in :mod:`heron.server.responses`.

Type errors are pydantic's (the app should turn them into 400s with
:func:`heron.server.errors.pydantic_error_message`); value limits raise
:class:`heron.server.errors.RequestValidationError` from :func:`validate_limits` and
``to_sampling_params``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from heron.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from heron.server.errors import RequestValidationError

MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap for /v1/completions
MAX_TOP_LOGPROBS = min(20, MAX_LOGPROBS)  # OpenAI's cap for chat top_logprobs
# Known OpenAI fields heron does not implement: refused when set rather than silently ignored.
UNSUPPORTED_FIELDS = ("logit_bias", "suffix", "tools", "functions", "tool_choice")

PromptType = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]




def _prompt_items(prompt: Any) -> list[Union[str, list[int]]]:
    """One prompt (a string or token ids) becomes a batch of one; a batch stays a batch."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (unknown fields are kept in
    ``model_extra`` and ignored unless listed in UNSUPPORTED_FIELDS)."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = 1  # null means 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None
    # vLLM-style extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: Optional[StrictStr] = None  # prefix-cache namespace: no sharing across salts

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
                prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """Build SamplingParams (OpenAI defaults for unset fields); ValueError -> 400."""
        validate_limits(self)
        opt = lambda v, d: d if v is None else v  # noqa: E731
        try:
            return SamplingParams(
                n=opt(self.n, 1), temperature=opt(self.temperature, 1.0),
                top_p=opt(self.top_p, 1.0), top_k=opt(self.top_k, 0), min_p=opt(self.min_p, 0.0),
                repetition_penalty=opt(self.repetition_penalty, 1.0),
                presence_penalty=opt(self.presence_penalty, 0.0),
                frequency_penalty=opt(self.frequency_penalty, 0.0), seed=self.seed,
                max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop_list,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens)
        except ValueError as exc:
            message = str(exc)
            field = message.split(" ", 1)[0]
            raise RequestValidationError(message, self._param_name(field)) from None

    def _param_name(self, field: str) -> Optional[str]:
        return field if field in type(self).model_fields else None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: PromptType
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        items = _prompt_items(v)
        if not items or any(len(p) == 0 for p in items):
            raise ValueError("the prompt must not be empty")
        if any(isinstance(p, list) and min(p) < 0 for p in items):
            raise ValueError("token ids must be non-negative")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """The batch of prompts: each a string or a list of token ids."""
        return _prompt_items(self.prompt)

    def to_sampling_params(self, default_max_tokens: Optional[int]) -> SamplingParams:
        """``max_tokens: null`` means default_max_tokens; ``echo`` with ``logprobs`` also asks
        for prompt logprobs."""
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.logprobs if self.echo else None
        return self._params(max_tokens, self.logprobs, prompt_logprobs)


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
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
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        """Messages as ``[{"role", "content"}]`` for a chat template."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_sampling_params(self, default_max_tokens: Optional[int]) -> SamplingParams:
        """``max_completion_tokens`` overrides ``max_tokens``; ``logprobs: true`` with
        ``top_logprobs: k`` asks for the sampled token's logprob plus the top k."""
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)

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
    """Server-side limits beyond SamplingParams' own checks; raises RequestValidationError."""
    n = 1 if req.n is None else req.n
    _check(1 <= n <= MAX_N, f"n must be in [1, {MAX_N}], got {n}", "n")
    _check(req.seed is None or -2**63 <= req.seed < 2**64,
           "seed must fit in 64 bits", "seed")
    n_stop = len(req.stop_list)
    _check(n_stop <= max_stop_strings,
           f"at most {max_stop_strings} stop strings are allowed, got {n_stop}", "stop")
    _check(req.stream or req.stream_options is None,
           "stream_options is only allowed when stream is true", "stream_options")
    for name in UNSUPPORTED_FIELDS:
        _check(not (req.model_extra or {}).get(name), f"{name} is not supported", name)
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        _check(0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS,
               f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}",
               "logprobs")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None:
        _check(0 <= req.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
               "top_logprobs")
        _check(req.logprobs, "logprobs must be true when top_logprobs is set", "logprobs")


# ---------------------------------------------------------------- responses
