"""The engine-core process: an ``LLMEngine`` driven by messages from the API process.

Loop: drain every pending input (without blocking when there is work; a short blocking poll
when idle) -> add / abort -> ``step()`` -> send the new part of each output as ``OutputDelta``s.
The loop never waits on the API side: sends are non-blocking with no high-water mark. It exits
on ``Shutdown`` or when its parent process is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, field

import msgspec
import zmq

from heron.config import EngineConfig
from heron.transport import messages as m
from heron.engine.detokenizer import stream_safe_end
from heron.transport.heartbeat import HeartbeatThread
from heron.engine.isolation import describe
from heron.engine.kv_events import KVEventPublisher
from heron.outputs import RequestOutput

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # how long an idle loop blocks waiting for input
STATS_INTERVAL_S = 0.5  # the longest gap between two OutputsMsg


@dataclass
class _Sent:
    """What has already been sent for one request: per completion, tokens and text length."""

    max_stop_len: int
    first: bool = True
    tokens: dict[int, int] = field(default_factory=dict)
    text: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # completions whose final delta was sent


def _metrics_fields(out: RequestOutput) -> dict:
    keys = ("arrival_time", "scheduled_time", "first_token_time", "finish_time",
            "num_preemptions")
    return {k: out.metrics[k] for k in keys if out.metrics.get(k) is not None}


class EngineCore:
    """Owns the engine and both sockets; ``run()`` returns when it should exit."""

    def __init__(self, engine, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int,
                 kv_events: KVEventPublisher | None = None):
        self.engine = engine
        self.kv_events = kv_events
        self.in_sock, self.out_sock = in_sock, out_sock
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(m.InputMsg)
        self.encoder = msgspec.msgpack.Encoder()
        self.sent: dict[str, _Sent] = {}
        self.counters = dict(prompt=0, generation=0, finished=0, rejected=0)
        self.last_send = 0.0

    def run(self) -> None:
        while os.getppid() == self.parent_pid:
            busy = self.engine.has_unfinished_requests()
            keep_going, deltas, changed = self._drain(0 if busy else IDLE_POLL_MS)
            if not keep_going:
                return
            if self.engine.has_unfinished_requests():
                deltas += [d for out in self.engine.step() for d in self._safe_deltas(out)]
            if self.kv_events is not None:
                self.kv_events.publish(self.engine.take_kv_events())
            if deltas or changed or time.monotonic() - self.last_send >= STATS_INTERVAL_S:
                self._send(m.OutputsMsg(deltas, self._stats()))
        logger.info("parent process is gone: engine core exits")

    # ---- input ---------------------------------------------------------------------------
    def _drain(self, timeout_ms: int) -> tuple[bool, list[m.OutputDelta], bool]:
        """Handle all pending input; returns (keep running, abort deltas, anything handled)."""
        deltas: list[m.OutputDelta] = []
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
            elif isinstance(msg, m.ResetPrefixCache):
                self.engine.reset_prefix_cache()
            else:
                for request_id in msg.request_ids:
                    deltas += self._abort(request_id)

    def _add(self, msg: m.AddRequest) -> None:
        try:
            params = m.params_from_dict(msg.params)
            # time in queue counts from the API side's receipt
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params,
                                    arrival_time=msg.arrival_time, cache_salt=msg.cache_salt)
        except Exception as exc:  # ValueError for bad input; anything else is logged too
            if not isinstance(exc, ValueError):
                logger.exception("add_request %s failed", msg.request_id)
            self.counters["rejected"] += 1
            self._send(m.ErrorMsg(msg.request_id, str(exc) or type(exc).__name__))
            return
        self.counters["prompt"] += len(msg.prompt_token_ids)
        self.sent[msg.request_id] = _Sent(max((len(s) for s in params.stop), default=0))

    def _abort(self, request_id: str) -> list[m.OutputDelta]:
        out = self.engine.abort_request(request_id)
        return self._deltas(out) if out is not None else []

    # ---- output --------------------------------------------------------------------------
    def _safe_deltas(self, out: RequestOutput) -> list[m.OutputDelta]:
        """``_deltas``, or, if building them raises, that request aborted with an error."""
        try:
            return self._deltas(out)
        except Exception as exc:  # noqa: BLE001 - one request's output must not stop the core
            logger.exception("output of request %s failed", out.request_id)
            self.engine.abort_request(out.request_id)
            self.sent.pop(out.request_id, None)
            self.counters["finished"] += 1
            return [m.OutputDelta(out.request_id, c.index, [], finish_reason="error",
                                  error=describe(exc)) for c in out.outputs]

    def _deltas(self, out: RequestOutput) -> list[m.OutputDelta]:
        """The new part of ``out``, one delta per completion that changed (or finished)."""
        sent = self.sent.get(out.request_id)
        if sent is None:
            return []
        deltas = [d for c in out.outputs if (d := self._delta(out, c, sent)) is not None]
        if deltas and sent.first:
            sent.first = False
            deltas[0].num_prompt_tokens = len(out.prompt_token_ids)
            deltas[0].num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                deltas[0].prompt_logprobs = [m.encode_logprobs(p) for p in out.prompt_logprobs]
        if out.finished:
            del self.sent[out.request_id]
            self.counters["finished"] += 1
        return deltas

    def _delta(self, out: RequestOutput, comp, sent: _Sent) -> m.OutputDelta | None:
        if comp.index in sent.done:
            return None
        n_tok, n_text = sent.tokens.get(comp.index, 0), sent.text.get(comp.index, 0)
        finished = comp.finish_reason is not None
        end = stream_safe_end(comp.text, n_text, finished, sent.max_stop_len)
        new_tokens = comp.token_ids[n_tok:]
        if not new_tokens and end == n_text and not finished:
            return None
        sent.tokens[comp.index], sent.text[comp.index] = len(comp.token_ids), end
        if finished:
            sent.done.add(comp.index)
        self.counters["generation"] += len(new_tokens)
        logprobs = None
        if comp.logprobs is not None:
            logprobs = [m.encode_logprobs(p) for p in comp.logprobs[n_tok:]]
        error = out.error if comp.finish_reason == "error" else None
        return m.OutputDelta(out.request_id, comp.index, new_tokens, comp.text[n_text:end],
                             logprobs, comp.finish_reason, comp.stop_reason, error,
                             **_metrics_fields(out))

    def _stats(self) -> m.StatsMsg:
        s, c = self.engine.stats(), self.counters
        return m.StatsMsg(
            num_running=s["num_running"], num_waiting=s["num_waiting"],
            num_unfinished_requests=len(self.engine.groups),
            kv_cache_usage=float(s["kv_cache_usage"]), num_free_blocks=s["num_free_blocks"],
            num_blocks=s["num_blocks"], num_preemptions=s["num_preemptions"],
            num_prompt_tokens_total=c["prompt"], num_generation_tokens_total=c["generation"],
            num_requests_finished_total=c["finished"],
            num_requests_rejected_total=c["rejected"], timestamp=time.monotonic(),
            prefix_cache_queries_total=s["prefix_cache_queries"],
            prefix_cache_hits_total=s["prefix_cache_hits"],
            num_cached_blocks=s["num_cached_blocks"],
            num_prefill_tokens_total=s["num_prefill_tokens"])

    def _send(self, msg) -> None:
        self.out_sock.send(self.encoder.encode(msg), zmq.NOBLOCK)
        if isinstance(msg, m.OutputsMsg):
            self.last_send = time.monotonic()


def _ready(engine) -> m.ReadyMsg:
    return m.ReadyMsg(
        model_name=engine.model_name, architecture=engine.arch.architecture,
        max_model_len=engine.max_model_len, vocab_size=engine.arch.vocab_size,
        num_kv_blocks=engine.kv_cache.num_blocks, block_size=engine.config.cache.block_size,
        eos_token_ids=list(engine.eos_token_ids),
        tokenizer_dir=str(engine.tokenizer_dir) if engine.tokenizer_dir else None)


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
    """Process main: build the engine, send ``ReadyMsg`` (or a fatal ``ErrorMsg``), serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s heron-core %(message)s")
    parent_pid = os.getppid()
    ctx = zmq.Context()
    in_sock = _connect(ctx, zmq.PULL, input_addr)
    out_sock = _connect(ctx, zmq.PUSH, output_addr)
    encoder = msgspec.msgpack.Encoder()
    kv_events = None
    heartbeat = HeartbeatThread(ctx, output_addr)
    heartbeat.start()
    try:
        from heron.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        if config.kv_events_endpoint:
            kv_events = KVEventPublisher(config.kv_events_endpoint)
            logger.info("publishing KV events on %s", config.kv_events_endpoint)
        out_sock.send(encoder.encode(_ready(engine)))
        EngineCore(engine, in_sock, out_sock, parent_pid, kv_events).run()
    except Exception as exc:
        logger.exception("engine core failed")
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            out_sock.send(encoder.encode(m.ErrorMsg(None, detail)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        raise SystemExit(1) from exc
    finally:
        heartbeat.stop()
        if kv_events is not None:
            kv_events.close()
        in_sock.close()
        out_sock.close()
        ctx.term()
