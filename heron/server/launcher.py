"""`heron serve`: start the engine-core process, then the HTTP server in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from typing import NoReturn

import uvicorn

from heron.config import EngineConfig
from heron.logging_config import configure_default
from heron.transport.async_client import AsyncEngineClient
from heron.server.app import ServerSettings, build_app
from heron.server.metrics import spec_decode_summary
from heron.server.shutdown import UVICORN_GRACE_S, DrainingServer, InFlightRequests

logger = logging.getLogger("heron.server")


STATS_INTERVAL_S = 10.0


async def log_engine_stats(client, interval: float = STATS_INTERVAL_S) -> None:
    """Every ``interval`` seconds with activity: throughput, queues, KV usage, preemptions."""
    last = client.stats()
    while client.is_alive():
        await asyncio.sleep(interval)
        now = client.stats()
        prompt = now.num_prompt_tokens_total - last.num_prompt_tokens_total
        gen = now.num_generation_tokens_total - last.num_generation_tokens_total
        if prompt or gen or now.num_running or now.num_waiting:
            queries = now.prefix_cache.queries - last.prefix_cache.queries
            hits = now.prefix_cache.hits - last.prefix_cache.hits
            logger.info("engine: prompt %.1f tok/s, generation %.1f tok/s, running %d, "
                        "waiting %d, KV cache %.1f%%, prefix-cache hit rate %.1f%%, "
                        "preemptions %d", prompt / interval, gen / interval,
                        now.num_running, now.num_waiting, 100 * now.kv_cache_usage,
                        100 * hits / queries if queries else 0.0,
                        now.scheduler.num_preemptions)
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


async def serve(config: EngineConfig, settings: ServerSettings, host: str, port: int) -> int:
    """Start the engine core, then serve it until SIGINT/SIGTERM (exit status 0) or an engine
    failure (1)."""
    client = await AsyncEngineClient.start(config)
    try:
        return await serve_client(client, settings, host, port, dtype=config.dtype)
    finally:
        with contextlib.suppress(Exception):
            await client.shutdown()


async def serve_client(client, settings: ServerSettings, host: str, port: int,
                       dtype: str = "") -> int:
    """Serve a started engine client until SIGINT/SIGTERM (0) or an engine failure (1); the
    stop sequence is ``shutdown.DrainingServer``'s (in-flight requests get
    ``settings.shutdown_timeout`` seconds)."""
    app = build_app(client, settings)
    state = app.state.heron
    stats = client.stats()
    logger.info("heron serving %s (%s) on %s://%s:%d  KV blocks: %s, max_model_len %d",
                settings.served_model_name, dtype,
                "https" if settings.http.ssl_certfile else "http", host, port,
                stats.num_blocks,
                client.max_model_len)
    in_flight = InFlightRequests(app, state)
    server = DrainingServer(uvicorn.Config(in_flight, host=host, port=port,
                                           timeout_graceful_shutdown=UVICORN_GRACE_S,
                                           **settings.http.uvicorn_kwargs()),
                            state, client, in_flight, settings.shutdown_timeout)
    watchers = [asyncio.ensure_future(exit_on_engine_failure(client, server, state))]
    if settings.openai.log_stats:  # --disable-log-stats: none
        watchers.append(asyncio.ensure_future(log_engine_stats(client)))
    try:
        await server.serve()
    finally:
        for task in watchers:
            task.cancel()
    return 1 if client.failure is not None else 0


def run(config: EngineConfig, settings: ServerSettings, host: str, port: int) -> NoReturn:
    """`heron serve`'s process: serve, then exit with ``serve``'s status. The process ends
    right after the listener closes (``os._exit``, logs and streams flushed first): the
    interpreter's teardown of torch and the rest takes seconds on a busy machine, seconds in
    which a supervisor would see a live process whose port refuses connections."""
    configure_default()  # INFO unless the caller (`heron serve -v / --quiet`) chose a level
    status = asyncio.run(serve(config, settings, host, port))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
