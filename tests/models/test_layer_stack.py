"""heron_cpu's LayerStack (``heron.models.layer_stack``): a decoder's layers in one C++ call per
step give the Python loop's output bit for bit (tokens and logprobs of every step), for each
Llama-family variant (GQA + llama3 rope, Mistral's sliding window, Qwen2's qkv bias, Qwen3's
q/k norms), each projection form (oneDNN-packed and column-major float32, plain ``F.linear``,
heron's grouped integers) and the real SmolLM2 GGUF; and it stands aside where it has no
exact form (an act-order permutation, a plugin op, ``--enforce-eager``).

The comparison is ``enforce_eager=True`` (the Python loop, always) against the default. Steps
mix prefill chunks and decodes (a small token budget), so every kernel sees ragged batches.
"""

from __future__ import annotations

import pytest
import torch

from heron import LLM, SamplingParams
from heron.kernels import cpu
from heron.layers import cpu_gemm
from heron.models import layer_stack
from quant_fixtures import write_quantized

ENGINE = dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=48, max_num_seqs=8,
              num_threads=2)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not cpu.load():
        pytest.skip("heron's CPU kernels did not build")


def _prompts(vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 9, 33, 1]  # 40 + 12 passes Mistral's window of 24
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()}
            for n in lengths]


def _stack_of(llm: LLM):
    decoder = llm.engine.core.executor.worker.runner.model.model
    stack = decoder.cpu_layer_stack
    if stack is not None and stack is not layer_stack.UNBUILT:
        assert stack.size() == len(decoder.layer_range)  # every layer of the model
    return stack


def _run(model: str, prompts, **kwargs):
    """(outputs as (tokens, logprobs) per prompt, the decoder's cpu_layer_stack afterwards)."""
    llm = LLM(model, **{**ENGINE, **kwargs})
    outs = llm.generate(prompts, GREEDY)
    results = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return results, _stack_of(llm)


def _assert_stack_matches_python(model: str, prompts, expect_stack: bool = True, **kwargs):
    stacked, stack = _run(model, prompts, **kwargs)
    python, eager_stack = _run(model, prompts, enforce_eager=True, **kwargs)
    assert eager_stack is layer_stack.UNBUILT  # --enforce-eager never builds it
    assert (stack is not None and stack is not layer_stack.UNBUILT) == expect_stack
    for i, (a, b) in enumerate(zip(stacked, python)):
        assert a[0] == b[0], f"prompt {i}: tokens differ"
        assert a[1] == b[1], f"prompt {i}: logprobs differ (not the same bits)"


@pytest.mark.parametrize("tiny", ["llama", "mistral", "qwen2", "qwen3"], indirect=True)
def test_the_stack_gives_the_python_loops_bits(tiny):
    _assert_stack_matches_python(str(tiny.path), _prompts(512))


def test_batch_invariant_float_gemm_matches_too(tiny, monkeypatch):
    """BATCH_INVARIANT: the packed weight for every row count, in the stack as in Python."""
    monkeypatch.setattr(cpu_gemm, "BATCH_INVARIANT", True)
    _assert_stack_matches_python(str(tiny.path), _prompts(512, seed=1))


def test_plain_float_weights_without_onednn_packing(tiny, monkeypatch):
    """Where oneDNN cannot pack, projections stay ``F.linear`` (the stack's PLAIN form)."""
    monkeypatch.setattr(cpu_gemm, "packing_available", lambda: False)
    _assert_stack_matches_python(str(tiny.path), _prompts(512, seed=2))


def test_grouped_integer_weights(tiny, tmp_path):
    write_quantized(tiny.path, tmp_path / "gptq", "gptq-4bit-g32")
    _assert_stack_matches_python(str(tmp_path / "gptq"), _prompts(512, seed=3))


def test_an_act_order_permutation_keeps_the_python_loop(tiny, tmp_path):
    """GPTQ act-order permutes the input features first: no exact C++ form, no stack."""
    write_quantized(tiny.path, tmp_path / "act", "gptq-4bit-act-order")
    _assert_stack_matches_python(str(tmp_path / "act"), _prompts(512), expect_stack=False)


def test_a_selected_plugin_op_keeps_the_python_loop(tiny, monkeypatch):
    """Inside the forward of a model with plugin ops selected, layers run in Python (where
    the plugin's kernel plugs in); the stack is not even built."""
    monkeypatch.setattr(layer_stack, "custom_ops_selected", lambda: True)
    stacked, stack = _run(str(tiny.path), _prompts(512))
    assert stack is layer_stack.UNBUILT


def test_smollm2_gguf():
    """The shipped model (Q4_1 projections, Q8_0 LM head): the grouped kernel in the stack."""
    prompts = _prompts(49152, seed=4)[:4]
    _assert_stack_matches_python(None, prompts, max_model_len=512)


def test_int8_activations_in_the_stack_match_the_python_loop(tiny, tmp_path):
    """--cpu-int8-dot: the stack calls quant_linear_int8 where the Python loop does."""
    write_quantized(tiny.path, tmp_path / "gptq", "gptq-4bit-g32")
    _assert_stack_matches_python(str(tmp_path / "gptq"), _prompts(512, seed=5),
                                 cpu_int8_dot=True)


def test_smollm2_gguf_with_int8_activations():
    prompts = _prompts(49152, seed=6)[:3]
    _assert_stack_matches_python(None, prompts, max_model_len=512, cpu_int8_dot=True)
