"""HF directory loading: sharded safetensors, reduced dtypes, config variants, missing weights."""

from __future__ import annotations

import json

import pytest
import torch

from hf_reference import hf_greedy, make_tiny_model
from heron import LLM, SamplingParams

PROMPT = [5, 17, 300, 42, 7, 99, 123, 250, 8, 64]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    hf = make_tiny_model("qwen3", path)
    hf.save_pretrained(path, max_shard_size="100KB")  # overwrite as several shards + index
    (path / "model.safetensors").unlink(missing_ok=True)
    return path, hf


def test_sharded_checkpoint_loads_exactly(sharded):
    path, hf = sharded
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    out = LLM(str(path)).generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                           ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPT, 12)[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_close_to_float32(sharded, dtype):
    path, _ = sharded
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    ref = LLM(str(path)).generate([PROMPT], params)[0].outputs[0]
    llm = LLM(str(path), dtype=dtype)
    assert all(p.dtype == getattr(torch, dtype) for p in llm.engine.runner.model.parameters())
    got = llm.generate([PROMPT], params)[0].outputs[0]
    assert got.token_ids[0] == ref.token_ids[0]
    first = ref.token_ids[0]
    assert got.logprobs[0][first][0] == pytest.approx(ref.logprobs[0][first][0], abs=0.1)


def test_transformers4_style_rope_keys(tmp_path):
    """config.json written by transformers 4 carries rope_theta / rope_scaling at top level."""
    hf = make_tiny_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = LLM(str(tmp_path)).generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                               ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPT, 8)[0]


def test_missing_weights_are_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.gate_up_proj.weight"):
        LLM(str(tmp_path))
