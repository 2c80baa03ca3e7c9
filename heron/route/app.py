"""The router's FastAPI app: ``build_app(config)``, usable in-process (a TestClient runs its
lifespan) or under uvicorn (``heron route``).

Routes: POST /v1/completions and /v1/chat/completions (forwarded by ``ingress``, plain ASGI
ahead of FastAPI's machinery), GET /v1/models (the union of the workers'), /health, /ready,
/metrics, and the admin /workers (GET, POST {"url"}, DELETE ?url=). With ``--api-key``
everything but /health, /ready and /metrics needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

from heron.route.admission import Admission, Refused
from heron.route.config import RouterConfig
from heron.route.guards import ENDPOINTS
from heron.route.health import HealthChecker
from heron.route.ingress import authorized, error_response, forward, unauthorized
from heron.route.metrics import RouterMetrics
from heron.route.policies import make_policy
from heron.route.proxy import Proxy
from heron.route.upstream import Upstream, UpstreamError
from heron.route.workers import WorkerRegistry, WorkerState

logger = logging.getLogger("heron.route")


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
        self.upstream = Upstream(config.connect_timeout_secs, config.request_timeout_secs)
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
        await self.upstream.start()
        self.proxy = Proxy(cfg, self.workers, self.policy, self.metrics, self.upstream)
        self.health = HealthChecker(cfg, self.workers, self.upstream, self.worker_headers())
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
        await self.upstream.close()


async def list_models(state: RouterState) -> dict:
    """The union of the available workers' /v1/models, by id (first seen wins)."""
    async def one(worker: WorkerState) -> list[dict]:
        try:
            status, body = await state.upstream.get(f"{worker.url}/v1/models",
                                                    state.worker_headers(),
                                                    state.config.health_check_timeout_secs)
            return json.loads(body).get("data", []) if status == 200 else []
        except (UpstreamError, ValueError, AttributeError):
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

    app = RouterApp(title="heron route", lifespan=lifespan, docs_url=None, redoc_url=None)
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
        if scope["type"] == "http" and not authorized(
                self.state.config.api_key, scope["path"],
                Headers(scope=scope).get("authorization")):
            await unauthorized()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RouterApp(FastAPI):
    """FastAPI, except that POST to a forwarding route goes straight to ``ingress.forward``
    (it checks the API key itself). Everything else, lifespan included, is FastAPI's."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ENDPOINTS:
            await forward(self.state.router, scope, receive, send)
            return
        await super().__call__(scope, receive, send)


class ForwardRoute:
    """The forwarding routes as FastAPI sees them (plain ASGI endpoints), so a wrong method
    gets its 405; ``RouterApp`` normally answers POST before routing."""

    def __init__(self, state: RouterState) -> None:
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        await forward(self.state, scope, receive, send)


def _add_routes(app: FastAPI, state: RouterState) -> None:
    for path in ENDPOINTS:
        app.add_route(path, ForwardRoute(state), methods=["POST"])

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
