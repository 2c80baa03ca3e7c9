"""StreamingLLM under tensor parallelism (gloo on 127.0.0.1, mp executor): two ranks, each
with half the heads and its own KV cache, give one rank's tokens and logprobs, and the
paper's cache run on HF's weights, with the middle blocks released under chunked prefill."""

from __future__ import annotations

import pytest

from hf_reference import assert_matches_hf, assert_same_outputs, make_tiny_model
from heron import LLM, SamplingParams
from streaming_reference import streaming_greedy

PROMPTS = [list(range(3, 3 + n)) for n in (9, 37)]
STREAMING = {"sink_tokens": 4, "window": 16}
ENGINE = dict(max_num_batched_tokens=8, block_size=4, num_kv_blocks=64)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-streaming-tp")
    return path, make_tiny_model("llama", path)


def _generate(path, **kwargs):
    llm = LLM(str(path), **ENGINE, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=5,
                            streaming_kv=STREAMING)
    try:
        return llm.generate(PROMPTS, params)
    finally:
        llm.engine.shutdown()


def test_tensor_parallel_streaming_equals_one_rank_and_the_paper(tiny_llama):
    path, hf = tiny_llama
    one = _generate(path)
    two = _generate(path, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert_same_outputs(one, two, 1e-5)
    assert_matches_hf(two, [streaming_greedy(hf, p, 30, 4, 16) for p in PROMPTS])
