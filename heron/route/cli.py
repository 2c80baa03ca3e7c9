"""`heron route`: flags (SGLang's gateway names where it has one) and the process.

Only argparse is imported at parser time; ``run`` imports the app. The process is torch-free.
SIGTERM/SIGINT drains: /ready and /health answer 503 and new requests are refused, the
requests in flight get up to ``--shutdown-timeout-secs`` to finish, then the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal

from heron.cli_help import HelpFormatter

logger = logging.getLogger("heron.route")

EPILOG = """examples:
  heron route --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002 --port 30000
  heron route --worker-file workers.txt --policy power_of_two --api-key sk-router
  heron route --launch 2 --policy cache_aware -- --max-model-len 2048   # 2 local workers
"""


def _router_flags(p) -> None:
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=30000, help="TCP port to listen on")
    g.add_argument("--worker-urls", nargs="+", default=None, metavar="URL",
                   help="the workers (heron serve or any OpenAI server)")
    g.add_argument("--worker-file", default=None, metavar="PATH",
                   help="a file of worker URLs, one a line; re-read when it changes")
    g.add_argument("--policy", default="round_robin",
                   choices=("round_robin", "random", "power_of_two", "least_load",
                            "cache_aware"), help="how a worker is picked")
    g.add_argument("--api-key", default=None,
                   help="the router's own key: clients and /workers admin need it")
    g.add_argument("--worker-api-key", default=None, help="the key sent to the workers")
    g.add_argument("--request-timeout-secs", type=float, default=1800.0,
                   help="one request, first byte to last")
    g.add_argument("--connect-timeout-secs", type=float, default=5.0)
    g.add_argument("--shutdown-timeout-secs", type=float, default=30.0,
                   help="SIGTERM: how long in-flight requests get to finish")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    g.add_argument("--cost-per-gpu-hour", type=float, default=None,
                   help="price of one worker-hour: heron_router:cost_per_million_tokens")
    g.add_argument("--launch", type=int, default=None, metavar="N",
                   help="start N `heron serve` workers here, each pinned to its share of the "
                        "cores, with KV events wired (serve flags after `--`)")
    g.add_argument("--worker-port", type=int, default=None, metavar="BASE",
                   help="--launch: worker i listens on BASE + i (default: free ports)")
    g.add_argument("--kv-events-port", type=int, default=None, metavar="BASE",
                   help="--launch: worker i publishes KV events on BASE + i (default: free)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _resilience_flags(p) -> None:
    g = p.add_argument_group("admission and retries")
    g.add_argument("--max-concurrent-requests", type=int, default=256,
                   help="requests in flight at once (0: unlimited)")
    g.add_argument("--queue-size", type=int, default=100,
                   help="requests waiting for a slot; more get 429")
    g.add_argument("--queue-timeout-secs", type=float, default=60.0,
                   help="longest wait for a slot, then 408")
    g.add_argument("--retry-max-retries", type=int, default=3)
    g.add_argument("--retry-initial-backoff-ms", type=int, default=50)
    g.add_argument("--retry-max-backoff-ms", type=int, default=2000)
    g.add_argument("--retry-backoff-multiplier", type=float, default=2.0)
    g.add_argument("--retry-jitter-factor", type=float, default=0.1)
    g.add_argument("--worker-429-cooldown-secs", type=float, default=1.0,
                   help="a worker that answered 429 gets no request for this long "
                        "(or its Retry-After)")
    g.add_argument("--max-worker-waiting-requests", type=int, default=None,
                   help="a worker with more waiting requests (its /metrics) is saturated")
    g = p.add_argument_group("circuit breaker and health checks")
    g.add_argument("--cb-failure-threshold", type=int, default=10)
    g.add_argument("--cb-success-threshold", type=int, default=3)
    g.add_argument("--cb-timeout-duration-secs", type=float, default=60.0)
    g.add_argument("--disable-circuit-breaker", action="store_true")
    g.add_argument("--health-check-interval-secs", type=float, default=10.0)
    g.add_argument("--health-check-timeout-secs", type=float, default=5.0)
    g.add_argument("--health-failure-threshold", type=int, default=3)
    g.add_argument("--health-success-threshold", type=int, default=2)


def _guard_and_policy_flags(p) -> None:
    g = p.add_argument_group("input guards")
    g.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="refuse prompts longer than this (estimated: characters / 4)")
    g.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for")
    g = p.add_argument_group("cache_aware policy")
    g.add_argument("--cache-threshold", type=float, default=0.3)
    g.add_argument("--balance-abs-threshold", type=int, default=64)
    g.add_argument("--balance-rel-threshold", type=float, default=1.5)
    g.add_argument("--max-tree-size", type=int, default=2 ** 20)
    g.add_argument("--eviction-interval-s", type=float, default=60.0)
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer directory (default: the workers' /server_info)")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("route", formatter_class=HelpFormatter, epilog=EPILOG,
                       help="an OpenAI gateway in front of heron serve workers",
                       description="A torch-free OpenAI gateway: policies, health checks, "
                                   "circuit breakers, retries and 429 backpressure.")
    _router_flags(p)
    _resilience_flags(p)
    _guard_and_policy_flags(p)
    return p


def fast_server_kwargs() -> dict[str, str]:
    """uvicorn's ``loop`` and ``http`` for the router: uvloop and httptools (the C event loop
    and parser; with them the router adds measurably less per request than under asyncio and
    h11), falling back to asyncio / h11 where they are not installed. Only the router: `heron
    serve` keeps its own choice."""
    import importlib.util

    def have(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return {"loop": "uvloop" if have("uvloop") else "asyncio",
            "http": "httptools" if have("httptools") else "h11"}


def serve_app(config) -> int:
    """Run the router under uvicorn until a signal; 0 after a clean drain."""
    import uvicorn

    from heron.route.app import build_app

    app = build_app(config)
    server = _DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=max(1, int(config.shutdown_timeout_secs)),
        **fast_server_kwargs()), app.state.router)
    logger.info("heron route listening on http://%s:%d", config.host, config.port)
    server.run()
    return 0


def run(args) -> int:
    from heron.route.config import RouterConfig

    logging.getLogger("heron.route").setLevel(args.log_level.upper())
    serve_args = list(args.serve_args or [])
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    config = RouterConfig.from_namespace(args)  # bad flags fail before any worker starts
    if args.launch:
        from heron.route.launch import launch_workers

        with launch_workers(args.launch, serve_args, base_port=args.worker_port,
                            kv_base_port=args.kv_events_port) as launched:
            urls = (*config.worker_urls, *(w.url for w in launched))
            return serve_app(dataclasses.replace(config, worker_urls=urls))
    if serve_args:
        raise SystemExit(f"heron route: unexpected arguments {serve_args} (serve flags "
                         "go after `--` with --launch)")
    if not args.worker_urls and not args.worker_file:
        logger.warning("no workers yet: add them with POST /workers or --worker-file")
    return serve_app(config)


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn that marks the router draining on the first signal (so /ready turns 503
        and new requests are refused while in-flight ones finish) and exits 0, not by
        re-raising the signal."""

        def __init__(self, config, router_state) -> None:
            super().__init__(config)
            self.router_state = router_state

        def handle_exit(self, sig, frame) -> None:
            self.router_state.admission.draining = True
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {s: signal.signal(s, self.handle_exit)
                        for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return DrainingServer


def _DrainingServer(config, router_state):  # noqa: N802 - builds the class lazily
    return _server_class()(config, router_state)
