"""The served path costs O(1) per token: a 4,000-token stream costs no more per token than a
40-token one. Counted, not timed: ``tracemalloc`` sums, step by step, the peak of the bytes
each step allocates above what was live before it (copies, joined text, built chunks and
JSON), over every step of a stream, divided by its tokens. Copying the output so far on each
step (what the cumulative kind does, shown as the contrast) grows this ~L-fold.

The engine core is replaced by the wire messages it would send (one token per step), routed
into a real ``AsyncEngineClient`` whose process and sockets are stand-ins; the server side
is the real streaming (SSE chunks with logprobs) and non-streaming (folding) code.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from types import SimpleNamespace

import pytest

from fake_core import LetterTokenizer, offline_client
from heron import SamplingParams
from heron.engine.core_outputs import RequestOutputKind, SequenceDelta
from heron.engine.stats import EngineStats
from heron.engine.detokenizer import IncrementalDetokenizer
from heron.outputs import CompletionOutput, RequestOutput
from heron.server import serving_completions
from heron.server.admission import AdmissionController
from heron.server.app import ServerSettings
from heron.server.metrics import ServerMetrics
from heron.server.protocol import CompletionRequest
from heron.server.request_runner import run_all_to_completion, stream_outputs
from heron.transport import messages as m

SHORT, LONG = 40, 4000
PROMPT = [5, 6, 7]


class _DeltaClient:
    """Stands in for the whole client when only the server is measured: yields the delta
    outputs routed to it."""

    tokenizer = LetterTokenizer()

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def _route(self, out: RequestOutput) -> None:
        self.queue.put_nowait(out)

    async def generate(self, request_id, prompt, params, cache_salt=None, output_kind=None):
        while True:
            out = await self.queue.get()
            yield out
            if out.finished:
                return


def _delta_outputs(request_id: str, length: int) -> list[RequestOutput]:
    """What the client yields for one request: one token, its text and logprobs per step."""
    outs = []
    for i in range(length):
        token, last = 10 + i % 200, i == length - 1
        comp = CompletionOutput(0, LetterTokenizer().decode([token]), [token],
                                [{token: (-0.5, 1), token + 1: (-1.5, 2)}],
                                "length" if last else None)
        outs.append(RequestOutput(request_id, None, PROMPT, [comp], finished=last,
                                  metrics={"arrival_time": 1.0, "first_token_time": 1.5}))
    return outs


def _messages(request_id: str, length: int, logprobs: bool) -> list[m.OutputsMsg]:
    """What the core sends for one request: one new token per step."""
    stats, msgs = EngineStats(), []
    for i in range(length):
        token = 10 + i % 200
        delta = SequenceDelta(request_id, 0, [token])
        if logprobs:
            delta.new_logprobs = [[(token, -0.5, 1), (token + 1, -1.5, 2)]]
        if i == 0:
            delta.num_prompt_tokens, delta.arrival_time, delta.first_token_time = 3, 1.0, 1.5
        if i == length - 1:
            delta.finish_reason, delta.finish_time = "length", 2.0
        msgs.append(m.OutputsMsg([delta], stats))
    return msgs


async def _settle(n: int = 8) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _measure(client, msgs, step) -> float:
    """Route each message, run ``step`` (what consumes it); bytes per token, summed over
    steps of each step's allocation peak above the memory live before it."""
    total = 0
    tracemalloc.start()
    try:
        for msg in msgs:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            client._route(msg)
            await step()
            total += tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return total / len(msgs)


async def _client_cost(length: int, kind: RequestOutputKind, detokenize: bool) -> float:
    client = offline_client(detokenize)
    params = SamplingParams(max_tokens=length, logprobs=1, ignore_eos=True)
    gen = client.generate("r", PROMPT, params, output_kind=kind)
    msgs = _messages("r", length, logprobs=True)
    first = asyncio.ensure_future(anext(gen))
    await _settle()
    client._route(msgs[0])
    await first
    delivered = [0]

    async def step():
        out = await anext(gen)
        delivered[0] += len(out.outputs[0].token_ids)

    cost = await _measure(client, msgs[1:], step)
    if kind is RequestOutputKind.DELTA:
        assert delivered[0] == length - 1  # each token delivered exactly once
    await gen.aclose()
    return cost


def _served(path: str, length: int):
    """(client, what to route to it) for the server alone or the whole path."""
    if path == "server":
        return _DeltaClient(), _delta_outputs("r", length)
    return offline_client(detokenize=True), _messages("r", length, logprobs=True)


async def _served_stream_cost(length: int, path: str) -> tuple[float, list[str]]:
    """/v1/completions streaming with logprobs: client -> stream_outputs -> SSE events."""
    client, msgs = _served(path, length)
    state = SimpleNamespace(client=client, metrics=ServerMetrics(), model_name="m",
                            settings=ServerSettings("m"))
    req = CompletionRequest(model="m", prompt=PROMPT, max_tokens=length, logprobs=1,
                            stream=True, stream_options={"include_usage": True})
    params = req.to_sampling_params(default_max_tokens=None)
    streams = [stream_outputs(state, "r", PROMPT, params)]
    admission = AdmissionController().admit(len(PROMPT))
    events = serving_completions._stream(req, state, "cmpl-x", [PROMPT], 1, streams, admission)
    first = asyncio.ensure_future(anext(events))
    await _settle()
    client._route(msgs[0])
    sent = [await first]

    async def step():
        sent.append(await anext(events))

    cost = await _measure(client, msgs[1:], step)
    sent += [e async for e in events]  # usage, [DONE]
    return cost, sent


async def _served_fold_cost(length: int, path: str):
    """A non-streaming request: the deltas folded into the final output."""
    client, msgs = _served(path, length)
    state = SimpleNamespace(client=client, metrics=ServerMetrics(), model_name="m")
    params = SamplingParams(max_tokens=length, logprobs=1, ignore_eos=True)
    http = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, False))
    runner = asyncio.ensure_future(
        run_all_to_completion(http, [stream_outputs(state, "r", PROMPT, params)]))
    await _settle()
    cost = await _measure(client, msgs, _settle)
    (final,) = await runner
    return cost, final


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def _per_token(cost_fn, *args):
    return _run(cost_fn(SHORT, *args)), _run(cost_fn(LONG, *args))


def _assert_flat(short: float, long: float, what: str) -> None:
    print(f"\n{what}: {short:.0f} B/token at {SHORT} tokens, {long:.0f} B/token at {LONG}")
    assert long <= 1.25 * short + 64, (what, short, long)


@pytest.mark.parametrize("detokenize", [pytest.param(False, id="tokens"),
                                        pytest.param(True, id="text")])
def test_client_delta_stream_costs_o1_per_token(detokenize):
    short, long = _per_token(_client_cost, RequestOutputKind.DELTA, detokenize)
    _assert_flat(short, long, f"client, delta outputs ({'text' if detokenize else 'tokens'})")


def test_cumulative_outputs_cost_o_length_per_token():
    """The contrast: the measure sees a copy of the output so far on every step."""
    short, long = _per_token(_client_cost, RequestOutputKind.CUMULATIVE, True)
    print(f"\nclient, cumulative outputs: {short:.0f} B/token at {SHORT} tokens, "
          f"{long:.0f} B/token at {LONG}")
    assert long > 10 * short


SERVED = pytest.mark.parametrize("path", ["server", "end-to-end"])


@SERVED
def test_served_stream_costs_o1_per_token(path):
    (short, _), (long, events) = _per_token(_served_stream_cost, path)
    _assert_flat(short, long, f"served stream, SSE with logprobs ({path})")
    assert len(events) == LONG + 2 and events[-1] == "data: [DONE]\n\n"
    assert f'"completion_tokens":{LONG}' in events[-2]


@SERVED
def test_served_fold_costs_o1_per_token(path):
    (short, _), (long, final) = _per_token(_served_fold_cost, path)
    _assert_flat(short, long, f"non-streaming fold ({path})")
    comp = final.outputs[0]
    assert len(comp.token_ids) == len(comp.logprobs) == len(comp.text) == LONG
    assert comp.finish_reason == "length" and final.finished


def test_detokenizer_costs_o1_per_token():
    """Update and stream (a stop string held back) without copying the text so far."""

    def cost(length):
        detok = IncrementalDetokenizer(LetterTokenizer(), PROMPT, stop=["zzzz", "never"])
        total, streamed = 0, []
        tracemalloc.start()
        try:
            for i in range(length):
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
                detok.update([10 + i % 200])
                streamed.append(detok.take_stream_text(finished=i == length - 1))
                total += tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert "".join(streamed) == detok.text == LetterTokenizer().decode(
            [10 + i % 200 for i in range(length)])
        return total / length

    _assert_flat(cost(SHORT), cost(LONG), "detokenizer update + stream text")


@pytest.mark.parametrize("backlog", [SHORT, LONG])
def test_a_slow_consumer_gets_one_merged_delta(backlog):
    """Everything that queued while the consumer was busy comes as one output, each token
    copied once (the merge is O(backlog))."""

    async def body():
        client = offline_client(detokenize=True)
        params = SamplingParams(max_tokens=backlog, logprobs=1, ignore_eos=True)
        gen = client.generate("r", PROMPT, params)
        first = asyncio.ensure_future(anext(gen))
        await _settle()
        for msg in _messages("r", backlog, logprobs=True):
            client._route(msg)
        out = await first
        assert out.finished and len(out.outputs) == 1
        comp = out.outputs[0]
        assert len(comp.token_ids) == len(comp.logprobs) == len(comp.text) == backlog
        assert comp.finish_reason == "length"
        assert out.metrics["first_token_time"] == 1.5 and out.metrics["finish_time"] == 2.0

    _run(body())
