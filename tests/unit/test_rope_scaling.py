"""Inverse frequencies and attention factors of every rope type against transformers'
ROPE_INIT_FUNCTIONS, the config parsing into (theta, scaling), and the rotary module's
per-token sequence lengths."""

from __future__ import annotations

import math

import pytest
import torch

from heron.attention.metadata import AttentionMetadata, ForwardContext, forward_context
from heron.layers.rope_scaling import (attention_factor, compute_inv_freq, dynamic_inv_freq,
                                       max_context)
from heron.layers.rotary import RotaryEmbedding
from heron.models.config import ModelArchConfig, rope_of

HEAD_DIM, MAX_POS = 32, 256
FACTORS = [1.0 + 0.25 * i for i in range(HEAD_DIM // 2)]
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "dynamic-3": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                   "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 16.0, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 64},
    "yarn-attn": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3,
                  "original_max_position_embeddings": 64},
    "yarn-nofactor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "short_factor": FACTORS,
                 "long_factor": [2 * f for f in FACTORS], "original_max_position_embeddings": 64},
    "longrope-factor": {"rope_type": "longrope", "short_factor": FACTORS, "factor": 2.0,
                        "long_factor": [3 * f for f in FACTORS], "attention_factor": 1.1,
                        "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def _hf_config(params: dict, theta: float):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                       max_position_embeddings=MAX_POS,
                       rope_parameters={**params, "rope_theta": theta})


@pytest.mark.parametrize("theta", [10000.0, 1e6])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seq_len", [None, 40, 64, 65, 200, 1000])
def test_inv_freq_and_attention_factor_match_hf(name, theta, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = CASES[name]
    kind = params["rope_type"]
    hf_config = _hf_config(dict(params), theta)
    hf_len = torch.tensor(seq_len) if kind == "dynamic" and seq_len else seq_len
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", seq_len=hf_len)
    got_theta, scaling = rope_of({**params, "rope_theta": theta}, MAX_POS)
    assert got_theta == theta
    got = compute_inv_freq(HEAD_DIM, theta, scaling, seq_len)
    # HF's dynamic NTK keeps the plain frequencies up to max_position_embeddings
    if kind == "dynamic" and (seq_len or 0) <= MAX_POS:
        torch.testing.assert_close(got, 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM),
                                   rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, ref_freq.float(), rtol=0, atol=0)
    assert attention_factor(scaling) == pytest.approx(ref_factor, rel=1e-12)


def test_dynamic_rows_match_hf_for_each_length():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, scaling = rope_of(CASES["dynamic-3"], MAX_POS)
    lengths = torch.tensor([300, 257, 1000, 4096])
    rows = dynamic_inv_freq(HEAD_DIM, 10000.0, scaling, lengths)
    for row, n in zip(rows, lengths):
        ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](_hf_config(dict(CASES["dynamic-3"]), 10000.0),
                                                "cpu", seq_len=n)
        torch.testing.assert_close(row, ref, rtol=0, atol=0)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, "unsupported rope scaling type 'ntk-by-parts'"),
    ({"rope_type": "linear"}, "lacks the required key.*factor"),
    ({"rope_type": "yarn", "factor": 2.0}, "original_max_position_embeddings"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
     "low_freq_factor, high_freq_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
      "original_max_position_embeddings": 64}, "short_factor has 1 entries"),
])
def test_bad_scaling_is_a_clear_error(scaling, message):
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(HEAD_DIM, 10000.0, scaling)


def _arch(**cfg) -> ModelArchConfig:
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=64,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=MAX_POS)
    return ModelArchConfig.from_hf({**base, **cfg})


def test_config_forms_of_rope_parameters():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    # transformers 5: theta inside rope_parameters
    arch = _arch(rope_parameters={**yarn, "rope_theta": 5e5})
    assert arch.rope_theta == 5e5 and arch.rope_scaling == yarn
    # transformers 4: top-level rope_theta, rope_scaling with the old "type" key
    arch = _arch(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    assert arch.rope_theta == 1e6
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # default rope_parameters plus a legacy rope_scaling (an --hf-overrides of an old key)
    arch = _arch(rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                 rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert arch.rope_scaling == {"rope_type": "dynamic", "factor": 2.0,
                                 "original_max_position_embeddings": MAX_POS}
    # Gemma-3 style: keyed by layer type; the model-wide fields are full attention's
    arch = _arch(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert (arch.rope_theta, arch.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert rope_of({"rope_type": "default", "rope_theta": 1e4}, MAX_POS) == (1e4, None)
    # a top-level original length wins for yarn / longrope / llama3 (as in HF)
    arch = _arch(rope_parameters={**yarn, "rope_theta": 1e4}, original_max_position_embeddings=32)
    assert arch.rope_scaling["original_max_position_embeddings"] == 32
    assert _arch().rope_scaling is None and _arch().rope_theta == 10000.0


@pytest.mark.parametrize("scaling, expected", [
    (None, MAX_POS), ({"rope_type": "linear", "factor": 4.0}, 4 * MAX_POS),
    ({"rope_type": "dynamic", "factor": 2.0}, 2 * MAX_POS),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, MAX_POS),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128}, 1024),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, 512),
])
def test_max_context(scaling, expected):
    _, standard = rope_of({**(scaling or {}), "rope_theta": 1e4}, MAX_POS)
    assert max_context(standard, MAX_POS) == expected


def _metadata(lengths: torch.Tensor) -> AttentionMetadata:
    n = lengths.numel()
    zeros = torch.zeros(n, dtype=torch.int64)
    return AttentionMetadata(zeros, zeros.view(1, -1), zeros[:1], zeros[:2], [0, n], [n], [n], 4,
                             rope_lengths=lengths)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_rotary_uses_each_tokens_sequence_length(name):
    """Each token is rotated for its own L (from the metadata), as HF rotates a whole forward
    whose longest sequence is L; without metadata, for the call's largest position + 1."""
    _, scaling = rope_of(CASES[name], 64)  # original length 64 for both
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, scaling)
    rope.reserve(512, torch.device("cpu"))
    positions = torch.tensor([3, 63, 70, 100, 5, 300])
    lengths = torch.tensor([40, 64, 71, 120, 150, 301])
    with forward_context(ForwardContext(_metadata(lengths), [], None)):
        cos, sin = rope(positions, torch.float32)
    for i, (p, n) in enumerate(zip(positions.tolist(), lengths.tolist())):
        inv = compute_inv_freq(HEAD_DIM, 10000.0, scaling, n)
        emb = torch.cat([p * inv, p * inv])
        torch.testing.assert_close(cos[i, 0], emb.cos() * attention_factor(scaling))
        torch.testing.assert_close(sin[i, 0], emb.sin() * attention_factor(scaling))
    # outside the runner: every token rotated for max(position) + 1 = 301
    cos_all, _ = rope(positions, torch.float32)
    inv = compute_inv_freq(HEAD_DIM, 10000.0, scaling, 301)
    torch.testing.assert_close(cos_all[0, 0], torch.cat([3 * inv, 3 * inv]).cos()
                               * attention_factor(scaling))


def _gguf(path, yarn_keys: dict) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 131072),
                       (w.add_embedding_length, 64), (w.add_feed_forward_length, 128),
                       (w.add_head_count, 4), (w.add_rope_freq_base, 1e6), (w.add_vocab_size, 32)]:
        add(value)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(32768)
    for name, value in yarn_keys.items():
        getattr(w, f"add_rope_scaling_yarn_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_yarn_metadata_becomes_hf_yarn(tmp_path):
    from heron.loader.gguf_loader import read_gguf_config

    _gguf(tmp_path / "a.gguf", {"beta_fast": 24.0, "beta_slow": 2.0, "log_mul": 0.0707,
                                "ext_factor": -1.0})
    cfg = read_gguf_config(tmp_path / "a.gguf")
    assert cfg["rope_scaling"] == pytest.approx({
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 24.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 0.707})
    arch = ModelArchConfig.from_hf(cfg)
    assert arch.rope_theta == 1e6 and attention_factor(arch.rope_scaling) == pytest.approx(1.0)
    RotaryEmbedding(16, arch.rope_theta, arch.rope_scaling)  # what rotary.py expects
    _gguf(tmp_path / "plain.gguf", {})
    scaling = ModelArchConfig.from_hf(read_gguf_config(tmp_path / "plain.gguf")).rope_scaling
    assert scaling == {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32768}
    assert attention_factor(scaling) == pytest.approx(0.1 * math.log(4.0) + 1)
    _gguf(tmp_path / "ext.gguf", {"ext_factor": 0.5})
    with pytest.raises(ValueError, match="yarn_ext_factor 0.5 is not supported"):
        read_gguf_config(tmp_path / "ext.gguf")
