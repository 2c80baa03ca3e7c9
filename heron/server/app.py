"""The FastAPI application: OpenAI routes, auth, body limits, draining, error shapes."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as PydanticRequestError
from fastapi.responses import JSONResponse, Response

import heron
from heron.engine.async_client import EngineDeadError
from heron.server.admission import AdmissionController, Overloaded
from heron.server.errors import RequestValidationError, error_body, pydantic_error_message
from heron.server.metrics import ServerMetrics
from heron.server.protocol import ChatCompletionRequest, CompletionRequest
from heron.server.responses import ModelCard, ModelList
from heron.server.serving_chat import create_chat_completion
from heron.server.serving_completions import create_completion


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = 256
    max_queued_tokens: int | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    cost_per_gpu_hour: float | None = None


class ServerState:
    """What every route needs: the engine client, admission, metrics, the draining flag."""

    def __init__(self, client, settings: ServerSettings) -> None:
        self.client = client
        self.settings = settings
        self.model_name = settings.served_model_name
        self.admission = AdmissionController(settings.max_queued_requests,
                                             settings.max_queued_tokens)
        self.metrics = ServerMetrics(cost_per_gpu_hour=settings.cost_per_gpu_hour)
        self.draining = False

    def admit(self, num_tokens: int):
        try:
            return self.admission.admit(num_tokens)
        except Overloaded:
            self.metrics.record_rejection("429")
            raise


def _error(status: int, message: str, type_: str, param=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, status), status_code=status,
                        headers=headers)


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(RequestValidationError)
    async def _ours(_, exc: RequestValidationError):
        state.metrics.record_rejection("400")
        return JSONResponse(exc.to_body(), status_code=400)

    @app.exception_handler(PydanticRequestError)
    async def _pydantic(_, exc: PydanticRequestError):
        state.metrics.record_rejection("400")
        message, param = pydantic_error_message(exc.errors())
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(ValueError)
    async def _value(_, exc: ValueError):
        state.metrics.record_rejection("400")
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(Overloaded)
    async def _overloaded(_, exc: Overloaded):
        return _error(429, str(exc), "rate_limit_exceeded",
                      headers={"Retry-After": str(exc.retry_after_seconds)})

    @app.exception_handler(EngineDeadError)
    async def _dead(_, exc: EngineDeadError):
        return _error(503, f"the engine is not running: {exc}", "service_unavailable")


def _install_guards(app: FastAPI, state: ServerState) -> None:
    @app.middleware("http")
    async def guards(request: Request, call_next):
        path = request.url.path
        if path.startswith("/v1/") or path in ("/tokenize", "/detokenize",
                                               "/reset_prefix_cache"):
            key = state.settings.api_key
            if key and request.headers.get("authorization") != f"Bearer {key}":
                return _error(401, "invalid or missing API key", "authentication_error")
            if state.draining:
                return _error(503, "the server is shutting down", "service_unavailable")
            if not state.client.is_alive():
                return _error(503, "the engine is not running", "service_unavailable")
            length = request.headers.get("content-length")
            if length and int(length) > state.settings.max_body_bytes:
                state.metrics.record_rejection("413")
                return _error(413, f"request body over {state.settings.max_body_bytes} bytes",
                              "invalid_request_error")
        return await call_next(request)


def build_app(client, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="heron", version=heron.__version__)
    state = ServerState(client, settings)
    app.state.heron = state
    _install_error_handlers(app, state)
    _install_guards(app, state)

    @app.get("/health")
    async def health():
        if not client.is_alive():
            return _error(503, "the engine is not running", "service_unavailable")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": heron.__version__}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=state.model_name,
                                         max_model_len=client.max_model_len)])

    @app.get("/metrics")
    async def metrics(request: Request):
        if client.is_alive():
            state.metrics.update_engine_stats(client.stats())
        body, content_type = state.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/stats")
    async def stats():
        """Engine stats as JSON (KV blocks, queues, preemptions) plus the core's pid."""
        return {**client.stats(), "engine_pid": client.pid, "engine_alive": client.is_alive()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Admin: free every cached KV block no request uses (before any later request)."""
        client.reset_prefix_cache()
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(req, request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(req, request, state)

    _install_tokenizer_routes(app, state)
    return app


def _install_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    from heron.server.serving_chat import apply_template

    @app.post("/tokenize")
    async def tokenize(body: dict):
        tokenizer = state.client.tokenizer
        if "messages" in body:
            ids = apply_template(tokenizer, ChatCompletionRequest(messages=body["messages"]))
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer(body["prompt"]).input_ids
        else:
            raise RequestValidationError("give 'prompt' (a string) or 'messages'", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.client.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: dict):
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise RequestValidationError("'tokens' must be a list of token ids", "tokens")
        vocab = state.client.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise RequestValidationError(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": state.client.tokenizer.decode(tokens)}
