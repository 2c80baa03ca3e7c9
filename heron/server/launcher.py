"""`heron serve`: start the engine-core process, then the HTTP server in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from heron.config import EngineConfig
from heron.transport.async_client import AsyncEngineClient
from heron.server.app import ServerSettings, build_app
from heron.server.metrics import spec_decode_summary

logger = logging.getLogger("heron.server")


class _Server(uvicorn.Server):
    """On SIGTERM/SIGINT: answer new requests 503, let in-flight ones finish, exit 0
    (stock uvicorn re-raises the signal after its graceful shutdown: exit status -15)."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.heron_state = state

    def handle_exit(self, sig, frame) -> None:
        self.heron_state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


STATS_INTERVAL_S = 10.0


async def log_engine_stats(client, interval: float = STATS_INTERVAL_S) -> None:
    """Every ``interval`` seconds with activity: throughput, queues, KV usage, preemptions."""
    last = client.stats()
    while client.is_alive():
        await asyncio.sleep(interval)
        now = client.stats()
        prompt = now["num_prompt_tokens_total"] - last["num_prompt_tokens_total"]
        gen = now["num_generation_tokens_total"] - last["num_generation_tokens_total"]
        if prompt or gen or now["num_running"] or now["num_waiting"]:
            queries = now["prefix_cache_queries_total"] - last["prefix_cache_queries_total"]
            hits = now["prefix_cache_hits_total"] - last["prefix_cache_hits_total"]
            logger.info("engine: prompt %.1f tok/s, generation %.1f tok/s, running %d, "
                        "waiting %d, KV cache %.1f%%, prefix-cache hit rate %.1f%%, "
                        "preemptions %d", prompt / interval, gen / interval,
                        now["num_running"], now["num_waiting"], 100 * now["kv_cache_usage"],
                        100 * hits / queries if queries else 0.0, now["num_preemptions"])
            spec = spec_decode_summary(now, last)
            if spec is not None:
                logger.info("speculative decoding: acceptance rate %.1f%%, mean acceptance "
                            "length %.2f, accepted per position %s, drafts %d",
                            100 * spec["acceptance_rate"], spec["mean_acceptance_length"],
                            spec["accepted_per_pos_rate"], spec["num_drafts"])
        last = now


async def exit_on_engine_failure(client, server: uvicorn.Server, state) -> None:
    """When the engine dies or freezes: refuse new work (503), let open responses end (their
    streams get an error event), then stop the server, which then exits non-zero."""
    reason = await client.wait_failed()
    logger.error("engine failed (%s): draining open requests, then exiting with status 1",
                 reason)
    state.draining = True
    server.should_exit = True


async def serve(config: EngineConfig, settings: ServerSettings, host: str, port: int,
                grace_period_s: float = 30.0) -> int:
    """Run until SIGINT/SIGTERM (exit status 0) or an engine failure (1); in-flight requests
    get ``grace_period_s`` to finish."""
    client = await AsyncEngineClient.start(config)
    try:
        app = build_app(client, settings)
        stats = client.stats()
        logger.info("heron serving %s (%s) on http://%s:%d  KV blocks: %s, max_model_len %d",
                    settings.served_model_name, config.dtype, host, port,
                    stats.get("num_blocks"), client.max_model_len)
        server = _Server(uvicorn.Config(
            app, host=host, port=port, log_level="warning",
            timeout_graceful_shutdown=int(grace_period_s)), app.state.heron)
        watchers = [asyncio.ensure_future(log_engine_stats(client)),
                    asyncio.ensure_future(exit_on_engine_failure(client, server,
                                                                 app.state.heron))]
        try:
            await server.serve()
        finally:
            for task in watchers:
                task.cancel()
        return 1 if client.failure is not None else 0
    finally:
        with contextlib.suppress(Exception):
            await client.shutdown()


def run(config: EngineConfig, settings: ServerSettings, host: str, port: int) -> int:
    logging.getLogger("heron").setLevel(logging.INFO)
    return asyncio.run(serve(config, settings, host, port))
