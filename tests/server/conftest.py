"""The server tier's ``server``: one `heron serve` subprocess per module on 127.0.0.1.

A module says how to start it by defining the ``server_args`` fixture (the command-line
arguments after ``serve``; a model path first, or the embedded SmolLM2 when none is given) and,
where needed, ``server_env`` (extra environment variables). The server must exit 0 on SIGTERM
at the end of the module.
"""

from __future__ import annotations

import pytest

from server_fixture import HeronServer


@pytest.fixture(scope="module")
def server_env() -> dict[str, str]:
    return {}


@pytest.fixture(scope="module")
def server(server_args, server_env):
    srv = HeronServer(*server_args, env=server_env)
    yield srv
    assert srv.stop() == 0
