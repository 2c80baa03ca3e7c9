"""The API side of the delta boundary, without an engine process: the client's reader turns
the core's SequenceDeltas into delta outputs through its OutputProcessor, holds back a
possible stop string, tells the core to finish a sequence that hit one (FinishSequences),
drops the tokens the core made meanwhile, aborts what its consumer left, and reports
rejections and failed requests."""

from __future__ import annotations

import asyncio

import pytest

from fake_core import offline_client, sent
from heron import SamplingParams
from heron.engine.core_outputs import RequestOutputKind, SequenceDelta
from heron.engine.stats import EngineStats
from heron.transport import messages as m
from heron.transport.async_client import RequestFailedError

A, B, C, D, E = range(5)  # tokens of the letters a..e


def _outputs(request_id, *deltas):
    return m.OutputsMsg([SequenceDelta(request_id, i, list(t), **kw) for i, t, kw in deltas],
                        EngineStats())


async def _start(client, request_id, params, **kw):
    gen = client.generate(request_id, [7, 8], params, **kw)
    first = asyncio.ensure_future(anext(gen))
    for _ in range(4):
        await asyncio.sleep(0)
    return gen, first


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_stop_string_is_held_back_then_finishes_the_sequence_in_the_core():
    async def body():
        client = offline_client()
        gen, first = await _start(client, "r", SamplingParams(stop=["cd"], max_tokens=50))
        assert isinstance(sent(client)[0], m.AddRequest)
        client._route(_outputs("r", (0, [A, B, C], {})))
        out = await first
        assert out.outputs[0].text == "ab"  # "c" may begin "cd": held back
        client._route(_outputs("r", (0, [D, E], {})))  # the core ran past the stop string
        out = await anext(gen)
        comp = out.outputs[0]
        assert out.finished and comp.text == "" and comp.token_ids == [D, E]
        assert (comp.finish_reason, comp.stop_reason) == ("stop", "cd")
        assert sent(client)[-1] == m.FinishSequences([("r", 0, "cd")])
        client._route(_outputs("r", (0, [A], {})))  # late tokens: nobody gets them
        with pytest.raises(StopAsyncIteration):
            await anext(gen)
        assert not client._processor.has("r") and "r" not in client._streams
        assert not any(isinstance(msg, m.Abort) for msg in sent(client))  # it ended

    _run(body())


def test_n2_completions_finish_apart_and_cumulative_folds_them():
    async def body():
        client = offline_client()
        params = SamplingParams(n=2, max_tokens=3)
        gen, first = await _start(client, "r", params, output_kind=RequestOutputKind.CUMULATIVE)
        client._route(_outputs("r", (0, [A], {}), (1, [B], {})))
        out = await first
        assert [c.text for c in out.outputs] == ["a", "b"] and not out.finished
        client._route(_outputs("r", (0, [C], dict(finish_reason="length"))))
        out = await anext(gen)
        assert [c.finish_reason for c in out.outputs] == ["length", None]
        client._route(_outputs("r", (1, [D], dict(finish_reason="length"))))
        out = await anext(gen)
        assert out.finished and [c.text for c in out.outputs] == ["ac", "bd"]

    _run(body())


def test_a_consumer_that_leaves_aborts_in_the_core_and_the_processor():
    async def body():
        client = offline_client()
        gen, first = await _start(client, "r", SamplingParams(max_tokens=50))
        client._route(_outputs("r", (0, [A], {})))
        await first
        await gen.aclose()
        assert sent(client)[-1] == m.Abort(["r"]) and not client._processor.has("r")

    _run(body())


def test_rejection_and_engine_failure_are_raised():
    async def body():
        client = offline_client()
        gen, first = await _start(client, "bad", SamplingParams())
        client._route(m.ErrorMsg("bad", "the prompt is empty"))
        with pytest.raises(ValueError, match="empty"):
            await first
        assert not client._processor.has("bad")
        gen, first = await _start(client, "r", SamplingParams(max_tokens=5))
        client._route(_outputs("r", (0, [], dict(finish_reason="error", error="boom"))))
        with pytest.raises(RequestFailedError, match="boom"):
            await first
        assert not any(isinstance(msg, m.Abort) for msg in sent(client))  # the core freed it

    _run(body())


def test_a_request_whose_output_processing_fails_is_aborted_in_the_core():
    async def body():
        client = offline_client()

        class Broken:
            def decode(self, ids, skip_special_tokens=True):
                raise RuntimeError("tokenizer bug")

        client._processor.tokenizer = Broken()
        gen, first = await _start(client, "r", SamplingParams(max_tokens=5))
        client._route(_outputs("r", (0, [A], {})))
        with pytest.raises(RequestFailedError, match="tokenizer bug"):
            await first
        assert sent(client)[-1] == m.Abort(["r"])

    _run(body())
