"""The server's options beyond admission and limits, grouped by what they shape: the OpenAI
responses (:class:`OpenAIOptions`) and the HTTP server (:class:`HttpOptions`). vLLM's flag
names are given where the option has one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from heron.sampling_params import MAX_LOGPROBS

VLLM_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class OpenAIOptions:
    """How requests are read and responses written.

    ``model_aliases``: further names a request's ``model`` may use (``--served-model-name a b``:
    "b"); responses always report the first name. ``sampling_defaults``: SamplingParams fields
    (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens) for requests that leave
    them unset (``--generation-config`` / ``--override-generation-config``). ``chat_template``:
    Jinja text replacing the tokenizer's (``--chat-template``)."""

    model_aliases: tuple[str, ...] = ()
    response_role: str = "assistant"  # --response-role
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    max_logprobs: int = VLLM_MAX_LOGPROBS  # more asked for: 400
    chat_template: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    log_requests: bool = True  # one log line per finished request
    log_stats: bool = True  # the periodic engine-stats log line

    def __post_init__(self) -> None:
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (heron's engine "
                             f"returns at most {MAX_LOGPROBS}), got {self.max_logprobs}")


@dataclass(frozen=True)
class CorsOptions:
    """``--allowed-origins`` and its companions, as vLLM (and Starlette's CORSMiddleware)."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class HttpOptions:
    """The HTTP server: docs, path prefix, CORS (off unless origins are given), TLS, uvicorn's
    log level, and how long a request body may take to arrive."""

    docs: bool = True  # /docs, /redoc, /openapi.json (--disable-fastapi-docs: off)
    root_path: str = ""  # behind a proxy that serves heron under a path prefix
    cors: CorsOptions | None = None
    uvicorn_log_level: str = "warning"
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    body_timeout_s: float = 30.0  # a body not complete this long after the headers: 408

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if self.body_timeout_s <= 0:
            raise ValueError(f"the body timeout must be > 0, got {self.body_timeout_s}")

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """What ``uvicorn.Config`` takes from these options. The HTTP protocol is pinned to
        h11 on the asyncio loop (uvicorn would pick httptools and uvloop when installed, as
        they are for `heron route`): the server's framing rules are tested on h11."""
        return {"log_level": self.uvicorn_log_level, "ssl_keyfile": self.ssl_keyfile,
                "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
                "access_log": self.uvicorn_log_level in ("info", "debug", "trace"),
                "http": "h11", "loop": "asyncio"}
