"""StreamingLLM requests (``streaming_kv``: attention sinks + a window, the middle evicted):
greedy tokens and logprobs equal the paper's own cache run on HF's weights (one token at a
time, raw keys re-rotated at their in-cache positions), under chunked prefill, preemption and
prefix hits; the KV a request holds stays bounded by sinks + window however long it runs."""

from __future__ import annotations

import pytest

from hf_reference import assert_matches_hf, hf_greedy, make_tiny_model
from heron import LLM, SamplingParams
from heron.models.kv_cache_spec import cdiv
from streaming_reference import streaming_greedy

SINKS, WINDOW = 4, 16
PROMPTS = [list(range(3, 3 + n)) for n in (7, 30, 45)]
MAX_NEW = 40


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-streaming")
    return path, make_tiny_model("llama", path)


@pytest.fixture(scope="module")
def refs(tiny_llama):
    _, hf = tiny_llama
    return [streaming_greedy(hf, p, MAX_NEW, SINKS, WINDOW) for p in PROMPTS]


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5,
                          streaming_kv={"sink_tokens": SINKS, "window": WINDOW}, **kwargs)


def _track_full_blocks(llm: LLM) -> list[int]:
    """After every step, the most blocks a request held in the full-attention group."""
    sched, most = llm.engine.scheduler, []
    update = sched.update_from_output

    def recording(out, result):
        held = [len(sched.requests[r].tables[0].owned()) for r in out.req_ids
                if r in sched.requests]
        most.append(max(held, default=0))
        return update(out, result)

    sched.update_from_output = recording
    return most


SETTINGS = {
    "chunked": dict(max_num_batched_tokens=8, block_size=4),
    # the engine's default (--streaming-kv): the pool is sized for it, requests of 85 tokens
    # in 10 blocks of 4
    "chunked+preempt": dict(max_num_batched_tokens=8, block_size=4, num_kv_blocks=10,
                            max_num_seqs=3, streaming_kv={"sink_tokens": SINKS,
                                                          "window": WINDOW}),
    "large-budget": dict(max_num_batched_tokens=256, block_size=16),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_matches_the_papers_cache(tiny_llama, refs, setting):
    path, _ = tiny_llama
    llm = LLM(str(path), **SETTINGS[setting])
    most = _track_full_blocks(llm)
    assert_matches_hf(llm.generate(PROMPTS, _params()), refs)
    bs, chunk = llm.engine.kv_cache.block_size, SETTINGS[setting]["max_num_batched_tokens"]
    assert max(most) <= cdiv(SINKS, bs) + cdiv(WINDOW - 1 + chunk, bs) + 1
    if setting == "chunked+preempt":
        assert llm.engine.scheduler.stats.num_preemptions > 0
    kv = llm.engine.kv_cache
    kv.reset_prefix_cache()
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_prefix_hits_reuse_only_sinks_and_window(tiny_llama, refs):
    path, _ = tiny_llama
    llm = LLM(str(path), max_num_batched_tokens=8, block_size=4)
    first = llm.generate(PROMPTS, _params())
    second = llm.generate(PROMPTS, _params())
    assert llm.engine.stats().prefix_cache.hits > 0
    assert_matches_hf(first, refs)
    assert_matches_hf(second, refs)


def test_a_window_longer_than_the_sequence_changes_nothing(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(str(path), max_num_batched_tokens=8, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5,
                            streaming_kv={"sink_tokens": 4, "window": 500})
    assert_matches_hf(llm.generate(PROMPTS, params),
                      [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS])


def test_engine_default_streams_unbounded_generation_in_bounded_memory(tiny_llama):
    """--streaming-kv for every request: a generation 20x the window, past the model's
    trained length (max_position_embeddings 512), in a pool that never holds it."""
    path, hf = tiny_llama
    llm = LLM(str(path), max_num_batched_tokens=16, block_size=4, num_kv_blocks=24,
              max_model_len=4096, streaming_kv={"sink_tokens": 4, "window": 16})
    most = _track_full_blocks(llm)
    params = SamplingParams(temperature=0, max_tokens=640, ignore_eos=True)
    out = llm.generate([PROMPTS[1]], params)[0].outputs[0]
    ref, _ = streaming_greedy(hf, PROMPTS[1], 640, 4, 16)
    assert out.token_ids == ref
    assert max(most) <= cdiv(4, 4) + cdiv(16 - 1 + 16, 4) + 1


def test_bad_specs_are_clear_errors(tiny_llama):
    path, _ = tiny_llama
    for bad in ({"window": 0}, {"sink_tokens": -1, "window": 8}, {"window": 8, "x": 1},
                (1, 2, 3), {"window": "8"}):
        with pytest.raises(ValueError, match="streaming_kv"):
            SamplingParams(streaming_kv=bad)
    llm = LLM(str(path))
    with pytest.raises(ValueError, match="streaming_kv keeps"):
        llm.generate([PROMPTS[0]], SamplingParams(streaming_kv={"window": 600}))


def test_smollm2_sinks_keep_perplexity_where_a_plain_window_blows_up(smollm2):
    """The paper's finding on the real model: over a text 10x the window, a window without
    sinks loses the model (perplexity far above the whole-context one); four sink tokens
    bring it back near it."""
    import math

    from heron.quantizer.calibration import held_out_text

    ids = smollm2.get_tokenizer()(held_out_text(), add_special_tokens=False)["input_ids"]
    ids, window, scored_from = ids[:1400], 128, 300

    def perplexity(streaming_kv) -> float:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, streaming_kv=streaming_kv)
        entries = smollm2.generate([ids], params)[0].prompt_logprobs
        lps = [entries[i][ids[i]][0] for i in range(scored_from, len(ids))]
        return math.exp(-sum(lps) / len(lps))

    whole = perplexity(None)
    sinks = perplexity({"sink_tokens": 4, "window": window})
    no_sinks = perplexity({"sink_tokens": 0, "window": window})
    print(f"perplexity: whole context {whole:.2f}, 4 sinks + {window} {sinks:.2f}, "
          f"window {window} alone {no_sinks:.2f}")
    assert sinks < 1.3 * whole, (whole, sinks, no_sinks)
    assert no_sinks > 1.5 * sinks, (whole, sinks, no_sinks)
