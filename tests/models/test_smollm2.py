"""The real SmolLM2-135M-Instruct (GGUF) under heron matches HF transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

from heron import SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and say why they are prime.",
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def chat_prompts(hf_tokenizer):
    return [hf_tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for c in CHATS]


def test_chat_template_and_tokenizer_match_hf(smollm2, chat_prompts):
    for chat, ref in zip(CHATS, chat_prompts):
        assert smollm2.apply_chat_template([{"role": "user", "content": chat}]) == list(ref)


def test_greedy_matches_hf_on_chat_prompts(smollm2, hf_model, chat_prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = smollm2.generate([list(p) for p in chat_prompts], params)
    with torch.no_grad():
        for prompt, out in zip(chat_prompts, outputs):
            # eos_token_id=None: HF runs past EOS like heron's ignore_eos (no suppression).
            # The explicit mask stops HF from masking prompt tokens equal to pad (<|im_end|>).
            ids = torch.tensor([list(prompt)])
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=None,
                                    pad_token_id=2)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == ref
            assert len(ref) == NEW_TOKENS


def test_chat_api_stops_at_eos_and_detokenizes(smollm2, hf_tokenizer):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert "Paris" in out.text
    assert out.text == hf_tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_tensor_parallel_3_equals_one_rank(smollm2, chat_prompts):
    """9 heads and 3 KV heads over 3 ranks (gloo): 3 query heads and one KV head each."""
    from heron import LLM

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(p) for p in chat_prompts[:3]]
    reference = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params)]
    llm = LLM(tensor_parallel_size=3, kv_cache_memory_gb=0.1, max_model_len=512)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()
    assert got == reference
