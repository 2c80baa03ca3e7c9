"""Sampling semantics on the real SmolLM2: seeds, n, stops, limits, filters, logprobs."""

from __future__ import annotations

import pytest
import torch

from heron import SamplingParams
from heron.sample.processing import _apply_penalties
from heron.sample.sampler import Sampler
from heron.worker.input_batch import SequenceState

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [smollm2.apply_chat_template(QUESTION), smollm2.apply_chat_template(POEM)]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_requests_reproduce_in_any_batch_mix(smollm2, prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(smollm2.generate([prompts[1]], seeded))[0]
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    mixed = smollm2.generate([prompts[0], prompts[1], prompts[0], prompts[1]],
                             [other, seeded, SamplingParams(temperature=0.5, seed=7), seeded])
    assert mixed[1].outputs[0].token_ids == alone
    assert mixed[3].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24,
                                    ignore_eos=True)
    assert _tokens(smollm2.generate([prompts[1]], different_seed))[0] != alone


def test_n_gives_n_outputs(smollm2, prompts):
    out = smollm2.generate([prompts[1]], SamplingParams(n=3, temperature=1.0, seed=5,
                                                        max_tokens=12, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_stop_string_across_token_boundary(smollm2, prompts):
    greedy = smollm2.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=32))[0]
    text = greedy.outputs[0].text
    assert text.startswith("The capital of France is Paris")
    tok = smollm2.get_tokenizer()
    # "al of Fr" starts inside " capital" and ends inside " France": it spans three tokens
    assert all("al of Fr" not in tok.decode([t]) for t in greedy.outputs[0].token_ids)
    out = smollm2.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=32,
                                                        stop=["al of Fr", "zzz"]))[0].outputs[0]
    assert out.text == "The capit" and out.finish_reason == "stop"
    assert out.stop_reason == "al of Fr"
    kept = smollm2.generate([prompts[0]], SamplingParams(
        temperature=0, max_tokens=32, stop="al of Fr", include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == "The capital of Fr"


def test_stop_token_ids_max_tokens_and_min_tokens(smollm2, prompts):
    greedy = smollm2.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=32))[0]
    ids = greedy.outputs[0].token_ids
    assert greedy.outputs[0].finish_reason == "stop" and ids[-1] == 2  # EOS
    stopped = smollm2.generate([prompts[0]], SamplingParams(
        temperature=0, max_tokens=32, stop_token_ids=[ids[3]]))[0].outputs[0]
    assert stopped.token_ids == ids[:4] and stopped.stop_reason == ids[3]
    short = smollm2.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert short.outputs[0].token_ids == ids[:3] and short.outputs[0].finish_reason == "length"
    longer = smollm2.generate([prompts[0]], SamplingParams(
        temperature=0, max_tokens=len(ids) + 5, min_tokens=len(ids) + 2))[0].outputs[0]
    assert len(longer.token_ids) >= len(ids) + 2 and 2 not in longer.token_ids[:len(ids) + 1]


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_degenerate_filters_equal_greedy(smollm2, prompts, filters):
    greedy = smollm2.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    sampled = smollm2.generate(prompts, SamplingParams(temperature=1.5, max_tokens=16, **filters))
    assert _tokens(sampled) == _tokens(greedy)


def test_logprobs_include_sampled_token_with_rank(smollm2, prompts):
    out = smollm2.generate([prompts[1]], SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                                        logprobs=4))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, position in zip(out.token_ids, out.logprobs):
        assert token in position and 4 <= len(position) <= 5
        ranks = sorted(rank for _, rank in position.values())
        assert ranks[:4] == [1, 2, 3, 4]
        assert all(lp <= 0 for lp, _ in position.values())


def test_penalties_follow_hf_and_openai_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seq = SequenceState("r", 0, [0], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                                                    frequency_penalty=0.25), ())
    seq.output_token_ids = [1, 1, 3]
    _apply_penalties(logits, [seq])
    # token 0: prompt only -> 2/2; token 1: seen twice -> -2*2 - 0.5 - 2*0.25; token 3: once
    assert logits.tolist() == [[1.0, -5.0, 1.0, 0.25 - 0.75]]


def test_sampler_respects_top_k_support():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    # seeded sequences, as the worker holds them: each with its own generator
    seqs = [SequenceState(str(i), i, [0], SamplingParams(temperature=1.0, top_k=3, seed=i), (),
                          generator=torch.Generator().manual_seed(i))
            for i in range(4)]
    top3 = logits.topk(3).indices
    for _ in range(20):
        out = Sampler(0)(logits, seqs)
        assert all(t in top3[i].tolist() for i, t in enumerate(out.token_ids))
