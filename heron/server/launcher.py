"""`heron serve`: start the engine-core process, then the HTTP server in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from heron.config import EngineConfig
from heron.engine.async_client import AsyncEngineClient
from heron.server.app import ServerSettings, build_app

logger = logging.getLogger("heron.server")


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after a graceful shutdown (exit status -15); heron exits 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def serve(config: EngineConfig, settings: ServerSettings, host: str, port: int,
                grace_period_s: float = 30.0) -> None:
    """Run until SIGINT/SIGTERM; in-flight requests get ``grace_period_s`` to finish."""
    client = await AsyncEngineClient.start(config)
    try:
        app = build_app(client, settings)
        stats = client.stats()
        logger.warning("heron serving %s (%s) on http://%s:%d  KV blocks: %s, max_model_len %d",
                       settings.served_model_name, config.dtype, host, port,
                       stats.get("num_blocks"), client.max_model_len)
        server = _Server(uvicorn.Config(
            app, host=host, port=port, log_level="warning",
            timeout_graceful_shutdown=int(grace_period_s)))
        await server.serve()
    finally:
        with contextlib.suppress(Exception):
            await client.shutdown()


def run(config: EngineConfig, settings: ServerSettings, host: str, port: int) -> int:
    asyncio.run(serve(config, settings, host, port))
    return 0
