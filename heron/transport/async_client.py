"""``AsyncEngineClient``: the API server's handle on an engine-core process.

The core runs in a spawned process (see ``core_process``). This side binds two ZMQ sockets in
a private temp dir: a PUSH for ``AddRequest`` / ``Abort`` / ``Shutdown`` (sent without blocking)
and a PULL read by one background task, which keeps the latest stats and routes each message's
``SequenceDelta``s through one ``OutputProcessor`` (text, stop strings, n > 1 grouping: all
outside the core's step loop), putting the delta ``RequestOutput``s it makes on per-request
queues; a stop string it finds goes back to the core as ``FinishSequences``. ``generate``
yields deltas (merging what queued while its consumer was busy), or folds them for the
cumulative and final-only kinds.

The core is dead once its process exits, it reports a fatal error, or its heartbeat (see
``heartbeat.py``) is silent for ``HEARTBEAT_TIMEOUT_S`` seconds (a frozen core is killed then).
Every pending request then fails with ``EngineDeadError`` and ``wait_failed`` returns.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import time
from typing import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from heron.config import EngineConfig
from heron.errors import EngineDeadError, EngineStartupError, RequestAbortedError, \
    RequestFailedError
from heron.transport import messages as m
from heron.transport.core_process import run_engine_core
from heron.tokenizer import load_tokenizer
from heron.logging_config import startup_phase
from heron.engine.core_outputs import RequestOutputKind
from heron.engine.output_processor import OutputProcessor
from heron.engine.stats import EngineStats
from heron.outputs import OutputAccumulator, RequestOutput, merge_deltas
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_MS = 200  # the reader checks that the core is alive at least this often
HEARTBEAT_TIMEOUT_S = 5.0  # silence from the core (no heartbeat, no output) that means dead


class AsyncEngineClient:
    """Talks to one engine-core process; use from a single asyncio event loop."""

    def __init__(self, proc, ctx: zmq.asyncio.Context, in_sock, out_sock, ready: m.ReadyMsg,
                 tmpdir: str, tokenizer) -> None:
        self._proc, self._ctx, self._in, self._out = proc, ctx, in_sock, out_sock
        self._tmpdir = tmpdir
        self.ready = ready
        self.tokenizer = tokenizer
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = list(ready.eos_token_ids)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(m.OutputMsg)
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its delta outputs
        # text, stop strings and n > 1 grouping of every request, outside the core's loop
        self._processor = OutputProcessor(tokenizer)
        self._stats = EngineStats(num_blocks=ready.num_kv_blocks,
                                  num_free_blocks=ready.num_kv_blocks)
        self._dead: str | None = None  # why the engine is unusable, once it is
        self._refusing: str | None = None  # set by abort_all: why new requests are refused
        self._failed = asyncio.Event()  # set when it died by failure (not by shutdown)
        self._last_heard = time.monotonic()
        self._closed = False
        self._reader = asyncio.create_task(self._read_loop(), name="heron-engine-reader")

    # ---- lifecycle -----------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig, startup_timeout: float = 300) -> AsyncEngineClient:
        """Spawn the core, wait for it to be ready; RuntimeError if it fails to start."""
        tmpdir = tempfile.mkdtemp(prefix="heron-ipc-")
        ctx = zmq.asyncio.Context()
        in_sock = zmq.Socket(ctx, zmq.PUSH)  # synchronous: sends never wait (NOBLOCK)
        in_sock.setsockopt(zmq.SNDHWM, 0)
        out_sock = ctx.socket(zmq.PULL)
        out_sock.setsockopt(zmq.RCVHWM, 0)
        for sock in (in_sock, out_sock):
            sock.setsockopt(zmq.LINGER, 0)
        in_sock.bind(f"ipc://{tmpdir}/input")
        out_sock.bind(f"ipc://{tmpdir}/output")
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, f"ipc://{tmpdir}/input",
                                          f"ipc://{tmpdir}/output"),
            name="heron-engine-core", daemon=True)
        proc.start()
        try:
            ready = await _wait_ready(proc, out_sock, startup_timeout)
            with startup_phase(logger, "tokenizer"):
                tokenizer = await asyncio.to_thread(load_tokenizer, ready.tokenizer_dir)
        except BaseException:
            _stop_process(proc, 0)
            _close(ctx, in_sock, out_sock, tmpdir)
            raise
        return cls(proc, ctx, in_sock, out_sock, ready, tmpdir, tokenizer)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to exit, wait up to ``timeout`` s, then terminate it; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._mark_dead("the engine was shut down", error=False)
        if self._proc.is_alive():
            try:
                self._in.send(self._encoder.encode(m.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(_stop_process, self._proc, timeout)
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        _close(self._ctx, self._in, self._out, self._tmpdir)

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def is_alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the engine died, if it died by failure rather than by ``shutdown``."""
        return self._dead if self._failed.is_set() else None

    async def wait_failed(self) -> str:
        """Return (the reason) once the engine has died by failure; never after a shutdown."""
        await self._failed.wait()
        return self._dead

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def stats(self) -> EngineStats:
        """The latest engine stats (refreshed every step, and every ~0.5 s when idle)."""
        return self._stats

    # ---- requests ------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, cache_salt: str | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA
                       ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as the request progresses; the last has ``finished=True``.

        ``output_kind`` DELTA (the default, O(1) per token): each output names the completions
        that progressed and carries only their new tokens, text and logprobs since the previous
        output (all that queued while the consumer was busy, merged), a completion's finish
        reason on its last piece. CUMULATIVE: everything so far each
        time (a fresh copy: O(length) per output). FINAL_ONLY: one output, at the end.
        Requests share cached prefixes only with requests of the same ``cache_salt``.

        Raises ValueError if the engine rejects the request, RequestFailedError if it fails
        it mid-way, EngineDeadError if the core dies, RequestAbortedError once ``abort_all``
        has been called. Closing the generator (or cancelling its consumer) before the end
        aborts the request.
        """
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._refusing is not None:
            raise RequestAbortedError(self._refusing)
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt_token_ids = list(prompt_token_ids)
        queue: asyncio.Queue = asyncio.Queue()
        acc = None
        if output_kind is not RequestOutputKind.DELTA:
            acc = OutputAccumulator(params.n, params.logprobs is not None)
        self._processor.add_request(request_id, None, prompt_token_ids, params,
                                    RequestOutputKind.DELTA)
        self._streams[request_id] = queue
        finished = False
        try:
            self._send(m.AddRequest(request_id, prompt_token_ids, params,
                                    time.monotonic(), cache_salt))
            while not finished:
                items = [await queue.get()]
                while not queue.empty():  # coalesce what a slow consumer missed
                    items.append(queue.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                out = merge_deltas(items)
                if out.error is not None:
                    finished = True  # the engine freed it already
                    raise RequestFailedError(out.error)
                finished = out.finished
                if acc is None:
                    yield out
                    continue
                acc.add(out)
                if output_kind is RequestOutputKind.CUMULATIVE:
                    yield acc.output(copy=True)
                elif finished:
                    yield acc.output(copy=False)
        except ValueError:
            finished = True  # rejected: the engine holds nothing for it
            raise
        finally:
            self._streams.pop(request_id, None)
            self._processor.abort(request_id)
            if not finished and self._dead is None:
                self._abort_nowait([request_id])

    def reset_prefix_cache(self) -> None:
        """Free the cached KV blocks no request uses; takes effect before any later request."""
        self._send(m.ResetPrefixCache())

    def abort_all(self, reason: str) -> int:
        """End every open request with ``RequestAbortedError(reason)`` and refuse new ones
        the same way; the core aborts them all (their KV blocks are freed) in one message.
        Returns how many requests were open."""
        self._refusing = reason
        request_ids = list(self._streams)
        for request_id in request_ids:
            self._processor.abort(request_id)  # tokens still arriving are dropped
            self._streams[request_id].put_nowait(RequestAbortedError(reason))
        if request_ids:
            self._abort_nowait(request_ids)
        return len(request_ids)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its ``generate`` then ends with finish_reason "abort"."""
        self._abort_nowait([request_id])

    def _abort_nowait(self, request_ids: list[str]) -> None:
        try:
            self._send(m.Abort(request_ids))
        except EngineDeadError:
            pass

    def _send(self, msg) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            data = self._encoder.encode(msg)
        except (OverflowError, TypeError) as exc:  # the edge should have refused it
            raise ValueError(f"the request cannot be sent to the engine: {exc}") from None
        try:
            self._in.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._mark_dead(f"cannot reach the engine core: {exc}")
            raise EngineDeadError(self._dead) from exc

    # ---- the reader task -----------------------------------------------------------------
    async def _read_loop(self) -> None:
        """Route every output message; notice within ~POLL_MS when the core is gone, and
        within HEARTBEAT_TIMEOUT_S when it is frozen."""
        try:
            while self._dead is None:
                if await self._out.poll(POLL_MS):
                    self._last_heard = time.monotonic()
                    self._route(self._decoder.decode(await self._out.recv()))
                elif not self._proc.is_alive():
                    self._mark_dead(f"the engine core died (exit code {self._proc.exitcode})")
                elif time.monotonic() - self._last_heard > HEARTBEAT_TIMEOUT_S:
                    self._mark_dead(f"the engine core stopped responding (no heartbeat for "
                                    f"{HEARTBEAT_TIMEOUT_S:.0f} s); it was killed")
                    self._proc.kill()
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("engine output reader failed")
            self._mark_dead(f"engine output reader failed: {exc!r}")

    def _route(self, msg) -> None:
        if isinstance(msg, m.OutputsMsg):
            self._stats = msg.stats
            processed = self._processor.process(msg.outputs)
            for out in processed.outputs:
                if (queue := self._streams.get(out.request_id)) is not None:
                    queue.put_nowait(out)
            try:
                if processed.stops:  # the core finishes those sequences, sends no more
                    self._send(m.FinishSequences(processed.stops))
                if processed.failed:  # their outputs end with "error"; free them in the core
                    self._send(m.Abort(processed.failed))
            except EngineDeadError:
                pass
        elif isinstance(msg, m.ErrorMsg):
            if msg.request_id is None:
                self._mark_dead(f"the engine core failed: {msg.message}")
            elif (queue := self._streams.get(msg.request_id)) is not None:
                self._processor.abort(msg.request_id)
                queue.put_nowait(ValueError(msg.message))

    def _mark_dead(self, reason: str, error: bool = True) -> None:
        """Fail every pending and future request with EngineDeadError(reason)."""
        if self._dead is not None:
            return
        self._dead = reason
        if error:
            logger.error("%s", reason)
            self._failed.set()
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(reason))


# ---- helpers ----------------------------------------------------------------------------------
async def _wait_ready(proc, out_sock, timeout: float) -> m.ReadyMsg:
    decoder = msgspec.msgpack.Decoder(m.OutputMsg)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await out_sock.poll(POLL_MS):
            msg = decoder.decode(await out_sock.recv())
            if isinstance(msg, m.ReadyMsg):
                return msg
            if isinstance(msg, m.ErrorMsg):
                raise EngineStartupError.from_detail(msg.message)
        elif not proc.is_alive():
            raise EngineStartupError(f"its process exited (exit code {proc.exitcode})")
    raise EngineStartupError(f"it was not ready within {timeout:.0f} s")


def _stop_process(proc, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _close(ctx, in_sock, out_sock, tmpdir: str) -> None:
    in_sock.close(linger=0)
    out_sock.close(linger=0)
    ctx.term()
    shutil.rmtree(tmpdir, ignore_errors=True)
