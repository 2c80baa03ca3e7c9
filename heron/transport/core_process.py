"""The engine-core process: a ``heron.engine.core.EngineCore`` driven by messages from the API
process.

Loop: drain every pending input (without blocking when there is work; a short blocking poll
when idle) -> add / abort / finish sequences -> ``step()`` -> send the step's
``SequenceDelta``s as they are (new tokens only; no text: the API side detokenizes). The loop
never waits on the API side: sends are non-blocking with no high-water mark. It exits on
``Shutdown`` or when its parent process is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import msgspec
import zmq

from heron.config import EngineConfig
from heron.engine.core_outputs import SequenceDelta
from heron.engine.kv_events import KVEventPublisher
from heron.logging_config import configure as configure_logging
from heron.transport import messages as m
from heron.transport.heartbeat import HeartbeatThread

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # how long an idle loop blocks waiting for input
STATS_INTERVAL_S = 0.5  # the longest gap between two OutputsMsg


class CoreServer:
    """Owns the engine core's side of both sockets; ``run()`` returns when it should exit."""

    def __init__(self, core, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int,
                 kv_events: KVEventPublisher | None = None):
        self.core = core
        self.kv_events = kv_events
        self.in_sock, self.out_sock = in_sock, out_sock
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(m.InputMsg)
        self.encoder = msgspec.msgpack.Encoder()
        self.last_send = 0.0

    def run(self) -> None:
        while os.getppid() == self.parent_pid:
            busy = self.core.has_unfinished_requests()
            keep_going, deltas, changed = self._drain(0 if busy else IDLE_POLL_MS)
            if not keep_going:
                return
            if self.core.has_unfinished_requests():
                deltas += self.core.step()  # EngineFault: fatal, the process reports it
            else:
                self.core.check_health()
            if self.kv_events is not None:
                self.kv_events.publish(self.core.take_kv_events())
            if deltas or changed or time.monotonic() - self.last_send >= STATS_INTERVAL_S:
                self._send(m.OutputsMsg(deltas, self.core.live_stats()))  # encoded at once
        logger.info("parent process is gone: engine core exits")

    # ---- input ---------------------------------------------------------------------------
    def _drain(self, timeout_ms: int) -> tuple[bool, list[SequenceDelta], bool]:
        """Handle all pending input; returns (keep running, abort deltas, anything handled)."""
        deltas: list[SequenceDelta] = []
        if not self.in_sock.poll(timeout_ms):
            return True, deltas, False
        while True:
            try:
                raw = self.in_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True, deltas, True
            msg = self.decoder.decode(raw)
            if isinstance(msg, m.Shutdown):
                return False, deltas, True
            if isinstance(msg, m.AddRequest):
                self._add(msg)
            elif isinstance(msg, m.FinishSequences):
                for request_id, index, stop in msg.sequences:
                    self.core.finish_sequence(request_id, index, stop)
            elif isinstance(msg, m.ResetPrefixCache):
                self.core.reset_prefix_cache()
            else:
                for request_id in msg.request_ids:
                    deltas += self.core.abort_request(request_id)

    def _add(self, msg: m.AddRequest) -> None:
        try:
            # time in queue counts from the API side's receipt
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                  arrival_time=msg.arrival_time, cache_salt=msg.cache_salt)
        except Exception as exc:  # ValueError for bad input; anything else is logged too
            if not isinstance(exc, ValueError):
                logger.exception("add_request %s failed", msg.request_id)
            self._send(m.ErrorMsg(msg.request_id, str(exc) or type(exc).__name__))

    # ---- output --------------------------------------------------------------------------
    def _send(self, msg) -> None:
        self.out_sock.send(self.encoder.encode(msg), zmq.NOBLOCK)
        if isinstance(msg, m.OutputsMsg):
            self.last_send = time.monotonic()


def _ready(core) -> m.ReadyMsg:
    return m.ReadyMsg(
        model_name=core.model_name, architecture=core.arch.architecture,
        max_model_len=core.max_model_len, vocab_size=core.arch.vocab_size,
        num_kv_blocks=core.kv_cache.num_blocks, block_size=core.config.cache.block_size,
        eos_token_ids=list(core.eos_token_ids),
        tokenizer_dir=str(core.tokenizer_dir) if core.tokenizer_dir else None,
        quantization=core.quantization, weight_bytes=core.weight_bytes)


def _connect(ctx: zmq.Context, kind: int, addr: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 2000)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)  # never block on a slow reader
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(addr)
    return sock


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Process main: build the core, send ``ReadyMsg`` (or a fatal ``ErrorMsg``), serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    configure_logging(process="core")  # the parent's level, through the environment
    parent_pid = os.getppid()
    ctx = zmq.Context()
    in_sock = _connect(ctx, zmq.PULL, input_addr)
    out_sock = _connect(ctx, zmq.PUSH, output_addr)
    encoder = msgspec.msgpack.Encoder()
    kv_events, core, ready = None, None, False
    heartbeat = HeartbeatThread(ctx, output_addr)
    heartbeat.start()
    try:
        from heron.engine.core import EngineCore

        core = EngineCore(config)
        if config.kv_events_endpoint:
            kv_events = KVEventPublisher(config.kv_events_endpoint)
            logger.info("publishing KV events on %s", config.kv_events_endpoint)
        out_sock.send(encoder.encode(_ready(core)))
        ready = True
        CoreServer(core, in_sock, out_sock, parent_pid, kv_events).run()
    except Exception as exc:
        # a startup failure is reported by the parent in one line (traceback: -v / DEBUG);
        # a failure while serving is a bug or a dead rank: its traceback is logged
        (logger.exception if ready else logger.debug)("engine core failed", exc_info=True)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            out_sock.send(encoder.encode(m.ErrorMsg(None, detail)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        raise SystemExit(1) from exc
    finally:
        heartbeat.stop()
        if core is not None:
            core.shutdown()
        if kv_events is not None:
            kv_events.close()
        in_sock.close()
        out_sock.close()
        ctx.term()
