"""The FastAPI application: OpenAI routes, error shapes, the state every route shares.

Auth, draining, engine liveness, content types and body limits are checked before routing
by ``guards.GuardMiddleware`` (CORS, when ``--allowed-origins`` turns it on, wraps it); routes
parse their bodies strictly (``protocol.parse_request``), check the model name
(``ServerState.check_model``) and run tokenizers off the event loop
(``ServerState.run_blocking``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as PydanticRequestError
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

import heron
from heron.server.admission import AdmissionController, Overloaded
from heron.server.errors import ModelNotFoundError, RequestValidationError, \
    pydantic_error_message
from heron.server.failures import FAILURES, classify
from heron.server.guards import GuardMiddleware, error_response, not_served_message
from heron.server.http_rules import allowed_methods
from heron.server.metrics import ServerMetrics, spec_decode_summary
from heron.server.openapi import SSE_OR_JSON, error_responses, install_openapi, json_body
from heron.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from heron.server.responses import ChatCompletionResponse, CompletionResponse, ModelCard, \
    ModelList
from heron.server.serving_chat import create_chat_completion
from heron.server.serving_completions import create_completion
from heron.server.settings import HttpOptions, OpenAIOptions
from heron.server.tokenizer_routes import (DetokenizeRequest, TokenizeRequest,
                                           install_tokenizer_routes)

TOKENIZER_THREADS = 2  # tokenization and chat templates run here, never on the event loop


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = 256
    max_queued_tokens: int | None = None
    max_queued_sequences: int | None = 1024  # prompts x n of every admitted request
    max_sequences_per_request: int = 256  # prompts x n of one request
    max_body_bytes: int = 4 * 1024 * 1024
    cost_per_gpu_hour: float | None = None
    shutdown_timeout: float = 30.0  # s in-flight requests get after SIGTERM; then cut (503)
    kv_events_endpoint: str | None = None  # where the engine publishes KV events (/server_info)
    openai: OpenAIOptions = field(default_factory=OpenAIOptions)  # how responses are made
    http: HttpOptions = field(default_factory=HttpOptions)  # CORS, TLS, docs, body timeout


class ServerState:
    """What every route needs: the engine client, admission, metrics, the draining flag."""

    def __init__(self, client, settings: ServerSettings) -> None:
        self.client = client
        self.settings = settings
        self.model_name = settings.served_model_name  # what responses report
        self.model_names = (settings.served_model_name, *settings.openai.model_aliases)
        self.admission = AdmissionController(settings.max_queued_requests,
                                             settings.max_queued_tokens,
                                             max_queued_sequences=settings.max_queued_sequences)
        self.metrics = ServerMetrics(cost_per_gpu_hour=settings.cost_per_gpu_hour)
        ready = getattr(client, "ready", None)
        if ready is not None:
            self.metrics.weight_bytes.labels(quantization=ready.quantization).set(
                ready.weight_bytes)
        self.draining = False
        self._executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="heron-tok")

    def admit(self, num_tokens: int, num_sequences: int = 1):
        try:
            return self.admission.admit(num_tokens, num_sequences)
        except Overloaded:
            self.metrics.record_rejection("429")
            raise

    def check_model(self, model: str | None) -> None:
        """ModelNotFoundError (404) unless ``model`` is one of the served names; a request
        without ``model`` is served (vLLM does the same)."""
        if model is not None and model not in self.model_names:
            raise ModelNotFoundError(model)

    async def run_blocking(self, fn, *args):
        """Run ``fn(*args)`` (tokenizing, templating) on the tokenizer threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(RequestValidationError)
    async def _ours(_, exc: RequestValidationError):
        state.metrics.record_rejection(str(exc.status_code))
        return error_response(exc.status_code, exc.message, exc.type, exc.param)

    @app.exception_handler(PydanticRequestError)
    async def _pydantic(_, exc: PydanticRequestError):
        state.metrics.record_rejection("400")
        message, param = pydantic_error_message(exc.errors())
        return error_response(400, message, "invalid_request_error", param)

    async def _failure(_, exc: Exception):  # refused by the engine, failed in it, or no engine
        status, message, type_ = classify(exc)
        if status == 400:
            state.metrics.record_rejection("400")
        return error_response(status, message, type_)

    for failure in FAILURES:
        app.add_exception_handler(failure, _failure)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):  # 404, 405, ...
        headers, message = dict(getattr(exc, "headers", None) or {}), str(exc.detail)
        if exc.status_code == 404:
            message = not_served_message(request.method, request.url.path)
        if exc.status_code == 405:
            methods = allowed_methods(app.routes, request.scope)
            headers["Allow"] = ", ".join(methods)
            message = f"{request.method} is not allowed on {request.url.path}: use " \
                      f"{' or '.join(m for m in methods if m not in ('HEAD', 'OPTIONS'))}"
        return error_response(exc.status_code, message, "invalid_request_error",
                              headers=headers or None)

    @app.exception_handler(Overloaded)
    async def _overloaded(_, exc: Overloaded):
        return error_response(429, str(exc), "rate_limit_exceeded",
                              headers={"Retry-After": str(exc.retry_after_seconds)})


def build_app(client, settings: ServerSettings) -> FastAPI:
    docs = settings.http.docs  # --disable-fastapi-docs: no /docs, /redoc, /openapi.json
    app = FastAPI(title="heron", version=heron.__version__,
                  openapi_url="/openapi.json" if docs else None,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    # --root-path (as vLLM sets it): routes match with or without the proxy's prefix
    app.root_path = settings.http.root_path
    state = ServerState(client, settings)
    app.state.heron = state
    _install_error_handlers(app, state)
    app.add_middleware(GuardMiddleware, state=state)
    cors = settings.http.cors
    if cors is not None:  # outermost: answers preflights, adds its headers to every answer
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods),
                           allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)
    # the one log line per finished request (--disable-log-requests turns it off)
    logging.getLogger("heron.server.requests").setLevel(
        logging.NOTSET if settings.openai.log_requests else logging.WARNING)
    _install_ops_routes(app, state)
    _install_openai_routes(app, state)
    install_tokenizer_routes(app, state)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                          DetokenizeRequest])
    return app


def _install_ops_routes(app: FastAPI, state: ServerState) -> None:
    client = state.client

    @app.api_route("/health", methods=["GET", "HEAD"], responses=error_responses(503))
    async def health():
        if not client.is_alive():
            return error_response(503, "the engine is not running", "service_unavailable")
        return {"status": "ok"}

    @app.api_route("/ready", methods=["GET", "HEAD"], responses=error_responses(503))
    async def ready():
        """200 while this server takes new requests; 503 once it drains or has no engine
        (a readiness probe: take it out of the load balancer)."""
        if not client.is_alive():
            return error_response(503, "the engine is not running", "service_unavailable")
        return {"status": "ready"}

    @app.get("/version")
    async def version():
        return {"version": heron.__version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {
        "application/openmetrics-text": {"schema": {"type": "string"}}}}})
    async def metrics(request: Request):
        if client.is_alive():
            state.metrics.update_engine_stats(client.stats())
        body, content_type = state.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/stats", responses=error_responses(401))
    async def stats():
        """The engine's ``EngineStats`` as JSON (speculative decoding as its acceptance
        summary), plus the core's pid and what admission holds."""
        admission = state.admission
        stats = client.stats()
        return {**msgspec.to_builtins(stats), "spec_decode": spec_decode_summary(stats),
                "engine_pid": client.pid, "engine_alive": client.is_alive(),
                "admitted_requests": admission.queued_requests,
                "admitted_sequences": admission.queued_sequences,
                "admitted_prompt_tokens": admission.queued_tokens}

    @app.get("/server_info", responses=error_responses(401))
    async def server_info():
        """What a cache-aware router needs to mirror this server's prefix cache: the block
        size, where KV events are published, the tokenizer directory (and --chat-template)
        to tokenize as this server does."""
        ready = getattr(client, "ready", None)
        return {"model": state.model_name, "block_size": getattr(ready, "block_size", None),
                "kv_events_endpoint": state.settings.kv_events_endpoint,
                "tokenizer_dir": getattr(ready, "tokenizer_dir", None),
                "chat_template": state.settings.openai.chat_template,
                "max_model_len": client.max_model_len, **_model_info(state)}

    @app.get("/model_info", responses=error_responses(401))
    async def model_info():
        """The model as SGLang's gateway registers a worker's (its fields, its route)."""
        return _model_info(state)

    @app.post("/reset_prefix_cache", responses=error_responses(401, 415, 503))
    async def reset_prefix_cache():
        """Admin: free every cached KV block no request uses (before any later request)."""
        client.reset_prefix_cache()
        return {"status": "ok"}


def _model_info(state: ServerState) -> dict:
    ready = getattr(state.client, "ready", None)
    return {"model_path": state.model_name,
            "tokenizer_path": getattr(ready, "tokenizer_dir", None), "is_generation": True}


_GENERATION_ERRORS = error_responses(400, 401, 404, 408, 413, 415, 429, 500, 503)


def _install_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401, 503))
    async def models():
        return ModelList(data=[ModelCard(id=name, root=state.client.model_name,
                                         max_model_len=state.client.max_model_len)
                               for name in state.model_names])

    _generation_route(app, state, "/v1/completions", CompletionRequest, CompletionResponse,
                      create_completion)
    _generation_route(app, state, "/v1/chat/completions", ChatCompletionRequest,
                      ChatCompletionResponse, create_chat_completion)


def _generation_route(app: FastAPI, state: ServerState, path: str, request_model,
                      response_model, create) -> None:
    """POST ``path``: the body parsed strictly as ``request_model``, answered by ``create``
    as JSON (``response_model``) or an SSE stream."""

    async def route(request: Request):
        req = parse_request(request_model, await request.body())
        state.check_model(req.model)
        return await create(req, request, state)

    app.post(path, response_model=response_model, name=create.__name__,
             responses={200: SSE_OR_JSON, **_GENERATION_ERRORS},
             openapi_extra=json_body(request_model))(route)
