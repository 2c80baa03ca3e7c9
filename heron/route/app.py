"""The router's FastAPI app: ``build_app(config)``, usable in-process (a TestClient runs its
lifespan) or under uvicorn (``heron route``).

Routes: POST /v1/completions and /v1/chat/completions (forwarded), GET /v1/models (the union
of the workers'), /health, /ready, /metrics, and the admin /workers (GET, POST {"url"},
DELETE ?url=). With ``--api-key`` everything but /health, /ready and /metrics needs
``Authorization: Bearer KEY``. A request goes: body guard -> input guards -> admission ->
policy -> proxy, and a client that leaves before its response started cancels the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

import httpx
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from heron.route.admission import Admission, Refused
from heron.route.config import RouterConfig
from heron.route.guards import ENDPOINTS, read_body, route_request
from heron.route.health import HealthChecker
from heron.route.metrics import RouterMetrics
from heron.route.policies import make_policy
from heron.route.proxy import Proxy
from heron.route.workers import WorkerRegistry, WorkerState
from heron.server.errors import error_body

logger = logging.getLogger("heron.route")
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(message, type_, param, status), status, headers=headers)


class RouterState:
    """Everything one router owns; ``app.state.router``. Built in ``build_app`` and wired up
    (workers checked, policy started) by the lifespan."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy = make_policy(config.policy, config)
        self.workers = WorkerRegistry(config, on_breaker_transition=self._transition)
        self.metrics = RouterMetrics(self.workers, self.policy.name, config.cost_per_gpu_hour)
        self.admission = Admission(config.max_concurrent_requests, config.queue_size,
                                   config.queue_timeout_secs)
        self.client: httpx.AsyncClient | None = None
        self.proxy: Proxy | None = None
        self.health: HealthChecker | None = None
        self._tasks: set[asyncio.Task] = set()  # runtime worker additions being checked

    def _transition(self, url: str, old: str, new: str) -> None:
        self.metrics.record_transition(url, old, new)

    @property
    def draining(self) -> bool:
        return self.admission.draining

    def worker_headers(self) -> dict[str, str]:
        key = self.config.worker_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def start(self) -> None:
        cfg = self.config
        timeout = httpx.Timeout(cfg.request_timeout_secs, connect=cfg.connect_timeout_secs)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        self.proxy = Proxy(cfg, self.workers, self.policy, self.metrics, self.client)
        self.health = HealthChecker(cfg, self.workers, self.client, self.worker_headers())
        for url in cfg.worker_urls:
            self.workers.add(url, "flag")
        self.health.reload_worker_file()
        # a first round before serving: health known and server_info there for the policy
        await asyncio.gather(*(self.health.check_worker(w) for w in self.workers.all()),
                             return_exceptions=True)
        for worker in self.workers.all():
            self.policy.on_worker_added(worker)
        self.workers.added_listeners.append(self._added)
        self.workers.removed_listeners.append(self.policy.on_worker_removed)
        await self.policy.start()
        self.health.start()

    def _added(self, worker: WorkerState) -> None:
        """A worker added at runtime: the policy hears of it after its first check."""
        async def check_then_tell() -> None:
            with contextlib.suppress(Exception):
                await self.health.check_worker(worker)
            if self.workers.get(worker.url) is worker:
                self.policy.on_worker_added(worker)
        task = asyncio.get_running_loop().create_task(check_then_tell())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.health is not None:
            await self.health.stop()
        await self.policy.stop()
        if self.client is not None:
            await self.client.aclose()


def authorized(state: RouterState, request: Request) -> bool:
    key = state.config.api_key
    if not key or request.url.path in OPEN_PATHS:
        return True
    scheme, _, token = (request.headers.get("authorization") or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


async def _until_disconnect(work, receive) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (which closes the upstream
    request, so the worker aborts it) and answer a 499 nobody will read."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.cancelled() and task.done():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return Response(status_code=499)


async def generate(state: RouterState, request: Request) -> Response:
    """The forwarding route: guards, admission, then the proxy."""
    cfg, t0 = state.config, time.monotonic()
    endpoint = ENDPOINTS[request.url.path]
    try:
        raw = await read_body(request.stream(), cfg.max_body_bytes)
    except ClientDisconnect:
        return Response(status_code=499)  # gone before its body arrived
    route_req = route_request(endpoint, raw, cfg)
    queued_at = time.monotonic()
    await state.admission.acquire()
    queued_s = time.monotonic() - queued_at
    state.metrics.queue_wait.observe(queued_s)
    stream = bool(route_req.body.get("stream"))
    try:
        resp = await _until_disconnect(
            state.proxy.forward(request.url.path, route_req, raw, request.headers, stream,
                                t0 + queued_s), request.receive)
    except BaseException:
        state.admission.release()
        raise
    if hasattr(resp, "on_close"):  # a stream: the slot is held until it ends
        resp.on_close.append(state.admission.release)
    else:
        state.admission.release()
    return resp


async def list_models(state: RouterState) -> dict:
    """The union of the available workers' /v1/models, by id (first seen wins)."""
    async def one(worker: WorkerState) -> list[dict]:
        try:
            resp = await state.client.get(f"{worker.url}/v1/models",
                                          headers=state.worker_headers(),
                                          timeout=state.config.health_check_timeout_secs)
            return resp.json().get("data", []) if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            return []
    seen: dict[str, dict] = {}
    for models in await asyncio.gather(*(one(w) for w in state.workers.available())):
        for model in models:
            if isinstance(model, dict) and model.get("id") not in seen:
                seen[model.get("id")] = model
    return {"object": "list", "data": list(seen.values())}


def build_app(config: RouterConfig) -> FastAPI:
    """The router app. The lifespan starts the health checks and the policy."""
    state = RouterState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        logger.info("heron route: %d workers, policy %s", len(state.workers), config.policy)
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="heron route", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = state

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        state.metrics.rejected.labels(exc.reason).inc()
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.retry_after_s)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(500, "internal router error", "internal_server_error")

    _add_routes(app, state)
    app.add_middleware(AuthMiddleware, state=state)
    return app


class AuthMiddleware:
    """``--api-key``: 401 (OpenAI's body) unless ``Authorization: Bearer KEY``; the probes and
    /metrics stay open. Plain ASGI, so routes still see ``http.disconnect``."""

    def __init__(self, app, state: RouterState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not authorized(self.state, Request(scope)):
            resp = error_response(401, "Incorrect API key provided.", "invalid_request_error")
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _add_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def forward(request: Request) -> Response:
        return await generate(state, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return await list_models(state)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return error_response(503, "the router is shutting down", "service_unavailable",
                                  retry_after=1)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        available = len(state.workers.available())
        if state.draining or not available:
            why = "shutting down" if state.draining else "no worker is available"
            return error_response(503, f"the router is not ready: {why}",
                                  "service_unavailable", retry_after=1)
        return JSONResponse({"status": "ready", "available_workers": available})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    _add_admin_routes(app, state)


def _add_admin_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/workers")
    async def list_workers() -> dict:
        return {"policy": state.policy.name,
                "workers": [w.describe() for w in state.workers.all()]}

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        try:
            url = (await request.json())["url"]
            worker = state.workers.add(url, "api")
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f'POST /workers takes {{"url": "http://host:port"}} '
                                  f"({exc})", "invalid_request_error", "url")
        return JSONResponse(worker.describe(), 201)

    @app.delete("/workers")
    async def remove_worker(url: str) -> Response:
        try:
            worker = state.workers.remove(url)
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error", "url")
        if worker is None:
            return error_response(404, f"no worker {url}", "NotFoundError", "url")
        return JSONResponse(worker.describe())
