"""OutputProcessor: sequence deltas -> RequestOutputs outside the core's step loop. DELTA
outputs carry each token and character exactly once, and the work per token does not grow
with the stream (counted, not timed); stop strings are held back, cut and reported to the
caller; FINAL_ONLY gives one output; n > 1 completions stay apart."""

from __future__ import annotations

import pytest

from heron.engine.core_outputs import RequestOutputKind, SequenceDelta
from heron.engine.output_processor import OutputProcessor
from heron.sampling_params import SamplingParams


class CharTokenizer:
    """Token i is the letter chr(97 + i % 26); token 26 is a space. Counts decoded ids."""

    def __init__(self) -> None:
        self.decoded_ids = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.decoded_ids += len(ids)
        return "".join(" " if i == 26 else chr(97 + i % 26) for i in ids)


def _stream(processor, request_id, tokens, index=0, finish_last=True):
    """Feed ``tokens`` one delta each; returns every output produced."""
    outs = []
    for k, token in enumerate(tokens):
        last = finish_last and k == len(tokens) - 1
        delta = SequenceDelta(request_id, index, [token], finish_reason="length" if last else None)
        outs += processor.process([delta]).outputs
    return outs


@pytest.mark.parametrize("length", [40, 4000])
def test_delta_outputs_emit_each_token_once_with_bounded_work_per_token(length):
    tok = CharTokenizer()
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=length),
                          RequestOutputKind.DELTA)
    tokens = [k % 26 for k in range(length)]
    outs = _stream(processor, "r", tokens)
    pieces = [c for o in outs for c in o.outputs]
    assert sum(len(c.token_ids) for c in pieces) == length  # no token sent twice
    assert "".join(c.text for c in pieces) == tok.decode(tokens)
    assert outs[-1].finished and pieces[-1].finish_reason == "length"
    assert not processor.requests
    # detokenizing decodes a window of the newest tokens, whatever the stream's length
    per_token = (tok.decoded_ids - length) / length  # minus the check decode above
    assert per_token <= 16


def test_a_stop_string_is_held_back_cut_and_reported():
    processor = OutputProcessor(CharTokenizer())
    params = SamplingParams(stop=["cde"], max_tokens=50)
    processor.add_request("r", None, [0], params, RequestOutputKind.DELTA)
    streamed, stops = "", []
    for token in [0, 1, 2, 3, 5, 6]:  # a b c d f g
        result = processor.process([SequenceDelta("r", 0, [token])])
        streamed += "".join(c.text for o in result.outputs for c in o.outputs)
        stops += result.stops
    # the last len("cde") - 1 characters may still begin the stop string: held back
    assert streamed == "abcd" and stops == []
    for token in [2, 3, 4]:  # c d e: the stop string
        result = processor.process([SequenceDelta("r", 0, [token])])
        streamed += "".join(c.text for o in result.outputs for c in o.outputs)
        stops += result.stops
    assert streamed == "abcdfg" and stops == [("r", 0, "cde")]
    assert not processor.requests  # finished here; the caller finishes it in the core
    assert processor.process([SequenceDelta("r", 0, [7])]).outputs == []  # late tokens


def test_final_only_gives_one_cumulative_output_per_request():
    processor = OutputProcessor(CharTokenizer())
    processor.add_request("r", "prompt", [0], SamplingParams(n=2, max_tokens=3),
                          RequestOutputKind.FINAL_ONLY)
    outs = []
    for step in range(3):
        last = step == 2
        outs += processor.process([
            SequenceDelta("r", i, [step + i], finish_reason="length" if last else None)
            for i in range(2)]).outputs
    assert len(outs) == 1 and outs[0].finished and outs[0].prompt == "prompt"
    assert [c.token_ids for c in outs[0].outputs] == [[0, 1, 2], [1, 2, 3]]
    assert [c.text for c in outs[0].outputs] == ["abc", "bcd"]


def test_an_error_delta_ends_the_request_with_its_reason():
    processor = OutputProcessor(None)
    processor.add_request("r", None, [0], SamplingParams(n=2), RequestOutputKind.CUMULATIVE)
    out = processor.process([SequenceDelta("r", i, [], finish_reason="error",
                                           error="IndexError: bad") for i in range(2)]).outputs
    assert out[0].finished and out[0].error == "IndexError: bad"
    assert [c.finish_reason for c in out[0].outputs] == ["error", "error"]
