"""GET /server_info: what `heron route`'s cache-aware policy discovers a worker with.

In-process (an engine client on no engine, ``fake_core``): the block size and tokenizer dir
come from the core's ready message, the KV events endpoint and --chat-template from the
server's settings; the route sits behind the API key like /stats. A real `heron serve` answers
it in tests/route/test_route_cache_aware.py.
"""

from __future__ import annotations

import asyncio

import httpx

from fake_core import offline_client
from heron.server.app import ServerSettings, build_app
from heron.server.settings import OpenAIOptions


def _get(settings: ServerSettings, headers: dict | None = None) -> httpx.Response:
    async def run():
        app = build_app(offline_client(), settings)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/server_info", headers=headers or {})

    return asyncio.run(run())


def test_server_info_reports_cache_geometry_and_events_endpoint():
    settings = ServerSettings("smol", kv_events_endpoint="tcp://*:5557",
                              openai=OpenAIOptions(chat_template="{{ messages }}"))
    body = _get(settings).json()
    assert body == {"model": "smol", "block_size": 16, "kv_events_endpoint": "tcp://*:5557",
                    "tokenizer_dir": None, "chat_template": "{{ messages }}",
                    "max_model_len": 1 << 20, "model_path": "smol", "tokenizer_path": None,
                    "is_generation": True}


def test_server_info_without_events_and_behind_the_api_key():
    assert _get(ServerSettings("smol")).json()["kv_events_endpoint"] is None
    locked = ServerSettings("smol", api_key="k")
    assert _get(locked).status_code == 401
    assert _get(locked, {"Authorization": "Bearer k"}).status_code == 200


def test_the_serve_flag_reaches_the_server_settings():
    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.serve_cli import server_settings

    args = build_parser().parse_args(["serve", "--kv-events-endpoint", "tcp://*:5557"])
    assert server_settings(args).kv_events_endpoint == "tcp://*:5557"
