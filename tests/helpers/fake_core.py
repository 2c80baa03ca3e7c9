"""An ``AsyncEngineClient`` on no engine process: tests route the core's messages into it
by hand (``client._route``) and read what it sent to the core (``sent(client)``)."""

from __future__ import annotations

import msgspec

from heron.engine.output_processor import OutputProcessor
from heron.transport import messages as m
from heron.transport.async_client import AsyncEngineClient


class LetterTokenizer:
    """Token i decodes to the letter chr(97 + i % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class _Proc:
    pid, exitcode = 0, None

    def is_alive(self):
        return True


class _InSock:
    def __init__(self) -> None:
        self.messages = []
        self._decoder = msgspec.msgpack.Decoder(m.InputMsg)

    def send(self, data, flags=0):
        self.messages.append(self._decoder.decode(data))


def offline_client(detokenize: bool = True) -> AsyncEngineClient:
    """Call inside a running event loop. Its reader never runs. Without ``detokenize`` its
    output processor makes no text (``client.tokenizer`` is still there for the server)."""
    ready = m.ReadyMsg("m", "llama", 1 << 20, 1000, 64, 16, [2], None)
    client = AsyncEngineClient(_Proc(), None, _InSock(), None, ready, "", LetterTokenizer())
    client._reader.cancel()
    if not detokenize:
        client._processor = OutputProcessor(None)
    return client


def sent(client: AsyncEngineClient) -> list:
    """Every message the client sent to the (absent) core."""
    return client._in.messages
