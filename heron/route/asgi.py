"""ASGI helpers of the router's hot path."""

from __future__ import annotations

import asyncio

from starlette.responses import Response


async def until_disconnect(work, receive):
    """Await ``work`` in this task while one watcher task reads ``receive``: a client that
    disconnects first cancels ``work`` (which closes the upstream request, so the worker aborts
    it) and gets a 499 nobody will read. Exceptions of ``work`` propagate; its result is
    returned.

    Cheaper than running ``work`` in a task of its own and waiting on both: one task per
    request, no ``asyncio.wait``. The cancellation is told apart from any other by the
    watcher's flag and withdrawn (``uncancel``) once caught.
    """
    task = asyncio.current_task()
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()
        return Response(status_code=499)
    finally:
        watcher.cancel()
