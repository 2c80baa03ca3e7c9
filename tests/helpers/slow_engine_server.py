"""`heron serve`'s HTTP server and stop sequence (``launcher.serve_client``) in front of a fake
engine that generates one token per request every ``TOKEN_INTERVAL_S`` up to its
``max_tokens`` (finish "length"): a request for 1000 tokens stays in flight for 50 s, longer
than any grace period the tests give it, unless its client leaves or the server aborts it.

Run as a script (the shutdown tests send it signals):
    python tests/helpers/slow_engine_server.py PORT SHUTDOWN_TIMEOUT RECORD_PATH [RELEASE_PATH]
At exit it writes RECORD_PATH (JSON): the request ids the fake core was sent
(``added``), those it was told to abort (``aborted``), and whether it was shut down. With
RELEASE_PATH, stopping the fake core waits until that file exists (at most 60 s): the test
decides how long the engine takes to stop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_core import LetterTokenizer, _InSock, _Proc  # noqa: E402

from heron.engine.core_outputs import SequenceDelta  # noqa: E402
from heron.engine.stats import EngineStats  # noqa: E402
from heron.server.app import ServerSettings  # noqa: E402
from heron.server.launcher import serve_client  # noqa: E402
from heron.transport import messages as m  # noqa: E402
from heron.transport.async_client import AsyncEngineClient  # noqa: E402

TOKEN_INTERVAL_S = 0.05
HOLD_LIMIT_S = 60.0  # the longest a RELEASE_PATH holds the stop
DIE_TOKEN = 999  # a request whose prompt is [DIE_TOKEN] makes the fake core die


class SlowEngineClient(AsyncEngineClient):
    """The real client (streams, abort, abort_all) over a fake core: ``run_core`` reads what
    the client sent and routes one token per open request back, every TOKEN_INTERVAL_S."""

    def __init__(self, release_path: str | None = None) -> None:
        ready = m.ReadyMsg("slow", "llama", 4096, 1000, 64, 16, [2], None)
        super().__init__(_Proc(), None, _InSock(), None, ready, "", LetterTokenizer())
        self._reader.cancel()
        self.running: dict[str, list[int]] = {}  # request id -> [tokens sent, max_tokens]
        self.was_shut_down = False
        self.release_path = Path(release_path) if release_path else None

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = self.was_shut_down = True
        self._mark_dead("the engine was shut down", error=False)
        deadline = time.monotonic() + HOLD_LIMIT_S
        while (self.release_path is not None and not self.release_path.exists()
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    def record(self) -> dict:
        sent = self._in.messages
        return {"added": [x.request_id for x in sent if isinstance(x, m.AddRequest)],
                "aborted": sorted({rid for x in sent if isinstance(x, m.Abort)
                                   for rid in x.request_ids}),
                "shut_down": self.was_shut_down}

    async def run_core(self) -> None:
        seen = 0
        while self._dead is None:
            for msg in self._in.messages[seen:]:
                if isinstance(msg, m.AddRequest) and msg.prompt_token_ids == [DIE_TOKEN]:
                    self._mark_dead("the engine core died (exit code -9)")
                elif isinstance(msg, m.AddRequest):
                    self.running[msg.request_id] = [0, msg.params.max_tokens or 16]
                elif isinstance(msg, m.Abort):
                    for request_id in msg.request_ids:
                        self.running.pop(request_id, None)
            seen = len(self._in.messages)
            now = time.monotonic()
            deltas = []
            for request_id, (sent, max_tokens) in list(self.running.items()):
                first = dict(num_prompt_tokens=1, arrival_time=now, scheduled_time=now,
                             first_token_time=now) if sent == 0 else {}
                last = sent + 1 == max_tokens
                deltas.append(SequenceDelta(request_id, 0, [sent % 26],
                                            finish_reason="length" if last else None, **first))
                self.running[request_id][0] = sent + 1
                if last:
                    del self.running[request_id]
            self._route(m.OutputsMsg(deltas, EngineStats(num_running=len(self.running))))
            await asyncio.sleep(TOKEN_INTERVAL_S)


async def main(port: int, shutdown_timeout: float, record_path: str,
               release_path: str | None = None) -> int:
    client = SlowEngineClient(release_path)
    core = asyncio.ensure_future(client.run_core())
    settings = ServerSettings(served_model_name="slow", shutdown_timeout=shutdown_timeout)
    try:
        return await serve_client(client, settings, "127.0.0.1", port)
    finally:
        core.cancel()
        Path(record_path).write_text(json.dumps(client.record()))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    sys.exit(asyncio.run(main(int(sys.argv[1]), float(sys.argv[2]), *sys.argv[3:5])))
