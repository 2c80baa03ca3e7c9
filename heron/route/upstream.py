"""The router's one HTTP client toward the workers: every upstream call (forwarded requests,
health checks, scrapes, the /v1/models union) goes through :class:`Upstream`.

Why aiohttp and not httpx: on this path the client is most of what the router adds. Measured
against an instant upstream on 127.0.0.1 (keep-alive, one request at a time), an httpx
``AsyncClient`` POST took ~0.7 ms P50 and aiohttp's ``ClientSession`` ~0.15 ms (a bare asyncio
connection ~0.05 ms): httpx goes through httpcore, anyio and h11 (several layers of Python per
event, the request written in two sends), aiohttp parses in C and writes a small request in
one send. Everything library-specific stays in this module, so a later switch is one file.

Contract:

* ``post`` returns an :class:`UpstreamResponse` as soon as the status line and headers are in;
  the body is read with ``read`` (whole) or ``chunks`` (as it arrives, undecoded: requests say
  ``accept-encoding: identity`` and nothing is decompressed).
* Failures are raised as :class:`UpstreamError` with a ``reason``: ``connect`` (refused or
  unreachable), ``timeout`` (no connection within the connect timeout, or a read silent for
  the read timeout) or ``read`` (the connection broke). The deadline of a whole request is
  the caller's (``asyncio.timeout``).
* A response must be closed (``close``), however it ended. A response read to its end goes
  back to the keep-alive pool; any other is closed with its connection, so a worker sees the
  disconnect and aborts the request. Cancelling a task inside ``post`` or ``chunks`` closes the
  connection too.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import aiohttp
from yarl import URL

# below uvicorn's keep-alive timeout (5 s): the pool drops an idle connection before the worker
# does, so a request is seldom written into a socket the worker is just closing
KEEPALIVE_S = 4.0
SKIPPED_AUTO_HEADERS = ("User-Agent", "Accept")
MAX_CACHED_URLS = 1024  # parsed URLs kept (a worker has a handful: its routes and probes)


class UpstreamError(Exception):
    """An upstream call failed; ``reason`` is ``connect``, ``timeout`` or ``read``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def failure_reason(exc: BaseException) -> str:
    """The metric label of a failure: connect, timeout or read."""
    if isinstance(exc, UpstreamError):
        return exc.reason
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's connect and read timeouts too
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    return "read"


def _wrapped(exc: BaseException) -> UpstreamError:
    return UpstreamError(failure_reason(exc), str(exc) or type(exc).__name__)


class UpstreamResponse:
    """A worker's response, headers in, body not yet read."""

    __slots__ = ("_resp", "status", "headers")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status: int = resp.status
        self.headers = resp.headers  # case-insensitive, read-only

    def picked_headers(self, names: tuple[str, ...]) -> dict[str, str]:
        """The headers named (lower-case names) that the worker sent."""
        return {k: v for k, v in self.headers.items() if k.lower() in names}

    async def read(self) -> bytes:
        """The whole body; raises :class:`UpstreamError`."""
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise _wrapped(exc) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, chunk by chunk; raises :class:`UpstreamError`."""
        content = self._resp.content
        while True:
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                raise _wrapped(exc) from None
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        """Back to the pool if read to its end, else the connection is closed."""
        if self._resp.content.is_eof():
            self._resp.release()
        else:
            self._resp.close()


class Upstream:
    """One keep-alive connection pool (no limit on connections) for every worker. ``start``
    inside the running loop, ``close`` when done. ``connect_timeout_s`` bounds opening a
    connection (a pooled one is reused at no cost), ``read_timeout_s`` any silence while
    reading a response."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}

    def _url(self, url: str) -> URL:
        """``url`` parsed once (aiohttp would parse the string on every request)."""
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= MAX_CACHED_URLS:
                self._urls.clear()
            parsed = self._urls[url] = URL(url)
        return parsed

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                         keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, trust_env=False,
            skip_auto_headers=SKIPPED_AUTO_HEADERS,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                          sock_read=self.read_timeout_s))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """Send a POST; the response once its headers are in. Raises :class:`UpstreamError`."""
        try:
            resp = await self._session.post(self._url(url), data=body, headers=headers,
                                            allow_redirects=False)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise _wrapped(exc) from None
        return UpstreamResponse(resp)

    async def get(self, url: str, headers: dict[str, str],
                  timeout_s: float) -> tuple[int, bytes]:
        """A whole GET within ``timeout_s``: (status, body). Raises :class:`UpstreamError`."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.get(self._url(url), headers=headers,
                                             allow_redirects=False) as resp:
                    return resp.status, await resp.read()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise _wrapped(exc) from None
