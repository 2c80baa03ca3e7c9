"""Tiny random-weight HF models and HF-transformers reference generations (the oracle)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

TINY_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
}


def make_tiny_model(arch: str, path: Path, seed: int = 0, **overrides):
    """Save a random tiny model of ``arch`` into ``path``; return the HF model (float32).
    ``overrides`` replace config fields (e.g. ``vocab_size``)."""
    import transformers

    config_cls, model_cls, extra = TINY_CONFIGS[arch]
    config = getattr(transformers, config_cls)(**{**TINY_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    model.save_pretrained(path)
    return model


def random_greedy_cases(model, prompt_lens, max_new_tokens: int, seed: int):
    """Random prompts (token ids 3..511, one per length in ``prompt_lens``, drawn with ``seed``)
    and ``hf_greedy`` of each: ``(prompts, [(tokens, top-5 logprobs per step), ...])``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in prompt_lens]
    return prompts, [hf_greedy(model, p, max_new_tokens) for p in prompts]


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, top_n: int = 5):
    """Greedy continuation with per-step top-n logprobs, from HF ``generate``."""
    ids = torch.tensor([prompt_ids])
    # explicit mask: otherwise HF masks prompt tokens equal to pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         eos_token_id=None, pad_token_id=0)  # eos=None: run past EOS
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = []
    for step_logits in out.logits:
        lp = step_logits[0].float().log_softmax(-1)
        values, ids = lp.topk(top_n)
        logprobs.append(dict(zip(ids.tolist(), values.tolist())))
    return tokens, logprobs


@torch.no_grad()
def hf_prompt_logprobs(model, prompt_ids: list[int]) -> list[float]:
    """logprob of prompt token i given tokens < i, for i >= 1."""
    logits = model(torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)
    return [float(logits[i - 1, prompt_ids[i]]) for i in range(1, len(prompt_ids))]


def assert_matches_hf(outputs, refs, atol: float = 1e-4) -> None:
    """heron ``RequestOutput``s against ``hf_greedy`` references: the same greedy tokens, and
    every reference top-n logprob within ``atol``."""
    import pytest

    for out, (ref_tokens, ref_logprobs) in zip(outputs, refs, strict=True):
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(out.prompt_token_ids)} diverged"
        for step, ref in enumerate(ref_logprobs):
            for token, lp in ref.items():
                assert got.logprobs[step][token][0] == pytest.approx(lp, abs=atol)


def assert_same_outputs(reference, outputs, atol: float) -> None:
    """Two heron runs of the same prompts (one rank against several, say): the same tokens,
    and per position the same top-n entries with logprobs within ``atol`` (sampled and
    prompt logprobs alike)."""
    for ref, out in zip(reference, outputs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        _assert_logprobs_close(ref.outputs[0].logprobs, out.outputs[0].logprobs, atol)
        _assert_logprobs_close(ref.prompt_logprobs, out.prompt_logprobs, atol)


def _assert_logprobs_close(reference, got, atol: float) -> None:
    """Per position {token: (logprob, rank)} (or None)."""
    import pytest

    if reference is None:
        assert got is None
        return
    assert len(got) == len(reference)
    for ref_lps, lps in zip(reference, got):
        if ref_lps is None:
            assert lps is None
            continue
        assert ref_lps.keys() == lps.keys()
        for token, (ref_lp, _) in ref_lps.items():
            assert lps[token][0] == pytest.approx(ref_lp, abs=atol)
