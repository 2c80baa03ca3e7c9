"""Every rope scaling type HF-exact past the original context: tiny Llama and Qwen2 with
max_position_embeddings 64, prompts of up to 170 tokens generating past 190, under chunked
prefill in batches that mix short and long sequences; HF runs one sequence at a time."""

from __future__ import annotations

import random

import pytest

from hf_reference import assert_matches_hf, hf_greedy, make_tiny_model
from heron import LLM, SamplingParams

ORIGINAL = 64
MAX_MODEL_LEN = 256  # factor 4 x 64
MAX_NEW = 20
HEAD_DIM = 16  # TINY_COMMON: hidden 64 / 4 heads
_FACTORS = [1.0 + 0.3 * i for i in range(HEAD_DIM // 2)]
ROPES = {
    # plain RoPE needs a native context as long as the test's
    "default": ({"rope_type": "default"}, MAX_MODEL_LEN),
    "linear": ({"rope_type": "linear", "factor": 4.0}, ORIGINAL),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, ORIGINAL),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
              "beta_fast": 16.0, "beta_slow": 2.0}, ORIGINAL),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "mscale": 0.8, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": ORIGINAL, "truncate": False}, ORIGINAL),
    "longrope": ({"rope_type": "longrope", "factor": 4.0, "short_factor": _FACTORS,
                  "long_factor": [2.5 * f for f in _FACTORS],
                  "original_max_position_embeddings": ORIGINAL}, ORIGINAL),
    "llama3": ({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}, ORIGINAL),
}
# short (< 64 with its outputs), straddling, long; the last extends the second's prompt
PROMPT_LENS = (30, 100, 170, 9)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]
    prompts.append(prompts[1] + [rng.randrange(3, 512) for _ in range(40)])
    return prompts


def _reset_hf_rope(model) -> None:
    """HF's dynamic NTK keeps the frequencies of the longest sequence it saw: start each
    sequence afresh, as a model that serves it alone."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len


@pytest.fixture(scope="module")
def tiny_rope(tmp_path_factory):
    """(arch, rope name) -> (checkpoint dir, prompts, HF references), built on first use."""
    built = {}

    def get(arch: str, name: str):
        if (arch, name) not in built:
            rope, max_pos = ROPES[name]
            path = tmp_path_factory.mktemp(f"{arch}-{name}")
            hf = make_tiny_model(arch, path, rope_scaling=dict(rope),
                                 max_position_embeddings=max_pos)
            prompts, refs = _prompts(), []
            for prompt in prompts:
                _reset_hf_rope(hf)
                refs.append(hf_greedy(hf, prompt, MAX_NEW))
            built[arch, name] = path, prompts, refs
        return built[arch, name]

    return get


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_chunked_mixed_batch_matches_hf(tiny_rope, arch, name):
    path, prompts, refs = tiny_rope(arch, name)
    llm = LLM(str(path), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=24, block_size=8)
    assert_matches_hf(llm.generate(prompts, PARAMS), refs)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_length_dependent_rope_whatever_the_chunking(tiny_rope, name):
    """One prompt per step, prompts in one step, or a budget that splits them unevenly: each
    token's rotation follows its own sequence's length."""
    path, prompts, refs = tiny_rope("llama", name)
    for budget in (512, 37):
        llm = LLM(str(path), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget,
                  block_size=16)
        assert_matches_hf(llm.generate(prompts, PARAMS), refs)
    # one sequence at a time through one engine (no state carried between them)
    llm = LLM(str(path), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64)
    for prompt, ref in zip(prompts[::-1], refs[::-1]):
        assert_matches_hf(llm.generate([prompt], PARAMS), [ref])


def test_hf_overrides_reach_the_model_and_workers(tiny_rope, tmp_path):
    """A default-rope checkpoint with a 64-token context, extended by --hf-overrides to yarn
    (in-process and through a worker process) equals HF's yarn model."""
    yarn_path, prompts, refs = tiny_rope("llama", "yarn")
    # the same seed: the same weights as the yarn checkpoint (rope has none)
    make_tiny_model("llama", tmp_path, rope_scaling={"rope_type": "default"},
                            max_position_embeddings=ORIGINAL)
    with pytest.raises(ValueError, match="--max-model-len 256 exceeds the model's context"):
        LLM(str(tmp_path), max_model_len=MAX_MODEL_LEN)
    overrides = {"rope_scaling": ROPES["yarn"][0]}
    for backend in ("uni", "mp"):
        llm = LLM(str(tmp_path), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32,
                  hf_overrides=overrides, distributed_executor_backend=backend)
        assert_matches_hf(llm.generate(prompts[:3], PARAMS), refs[:3])
        del llm
