"""Bad input gets a clear error and never disturbs the requests already being served."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(max_tokens=-5), "max_tokens must be at least 1"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(n=0), "n must be in"),
    (dict(logprobs=100), "logprobs must be in"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens (5) must not exceed max_tokens (2)"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path / "empty"))


def test_bad_dtype_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="unsupported dtype"):
        LLM(dtype="int3")
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported architecture 'BertModel'"):
        LLM(str(tmp_path))


def test_bad_prompts_rejected_while_serving(smollm2):
    engine = smollm2.engine
    good = smollm2.apply_chat_template([{"role": "user", "content": "Count to five."}])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("good", good, params)
    engine.step()
    bad_inputs = [
        ("", "the prompt is empty"),
        ([], "the prompt is empty"),
        ([1] * engine.max_model_len, "max_model_len"),
        ([10**9], "out of the vocabulary"),
    ]
    for prompt, message in bad_inputs:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="duplicate request id"):
        engine.add_request("good", good, params)
    finals = []
    for _ in range(100):
        finals += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert [o.request_id for o in finals] == ["good"]
    assert len(finals[0].outputs[0].token_ids) == 12
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_one_bad_prompt_in_a_batch_queues_nothing(smollm2):
    with pytest.raises(ValueError, match="empty"):
        smollm2.generate(["fine prompt", ""], SamplingParams(max_tokens=4))
    assert not smollm2.engine.has_unfinished_requests()
    out = smollm2.generate(["fine prompt"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_abort_frees_blocks(smollm2):
    engine = smollm2.engine
    engine.add_request("to-abort", "Tell me a long story.", SamplingParams(max_tokens=50, n=2,
                                                                       ignore_eos=True))
    engine.step()
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks
    out = engine.abort_request("to-abort")
    assert all(o.finish_reason == "abort" for o in out.outputs)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.has_unfinished_requests()


def test_prompt_that_can_never_fit_is_rejected(tmp_path):
    from hf_reference import make_tiny_model

    make_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="exceeds the KV cache capacity"):
        LLM(str(tmp_path), max_model_len=256, block_size=4, num_kv_blocks=8)
    llm = LLM(str(tmp_path), block_size=4, num_kv_blocks=8)  # max_model_len clamps to 32
    assert llm.engine.max_model_len == 32
    with pytest.raises(ValueError, match="max_model_len is 32"):
        llm.generate([[5] * 40])
