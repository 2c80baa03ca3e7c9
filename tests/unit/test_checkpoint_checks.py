"""Checkpoints heron cannot run (quantized, unexpected tensors, odd ggml types) fail the load."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import hf_greedy
from heron import LLM, SamplingParams
from heron.loader.checkpoint_checks import describe_quantization
from heron.loader.gguf_loader import read_gguf_config

PROMPT = [5, 17, 300, 42, 7, 99, 123, 250, 8, 64]

FP8_CONFIG = {  # as llm-compressor writes it for an FP8 (dynamic per-token) recipe
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True}}},
}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
               "sym": True}


@pytest.fixture
def ckpt(tiny, tmp_path):
    """A fresh copy of the tiny Llama directory, plus helpers to edit config and tensors."""
    src, _ = tiny
    path = shutil.copytree(src, tmp_path / "model")

    class Ckpt:
        dir = path

        @staticmethod
        def edit_config(**changes):
            cfg = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**cfg, **changes}))

        @staticmethod
        def edit_tensors(fn):
            tensors = load_file(path / "model.safetensors")
            fn(tensors)
            save_file(tensors, path / "model.safetensors")

    return Ckpt


def _add_weight_scales(tensors):
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        tensors[name.replace(".weight", ".weight_scale")] = torch.ones(tensors[name].shape[0], 1)


def test_fp8_config_with_float_weights_is_refused(ckpt):
    ckpt.edit_config(quantization_config=FP8_CONFIG)
    ckpt.edit_tensors(_add_weight_scales)
    with pytest.raises(ValueError, match=r"_proj.weight has dtype torch.float32 where the "
                                         r"declared quantization stores torch.float8_e4m3fn"):
        LLM(str(ckpt.dir))


def test_gptq_config_with_float_tensors_is_refused(ckpt):
    ckpt.edit_config(quantization_config=GPTQ_CONFIG)
    with pytest.raises(ValueError, match=r"checkpoint has 14 tensors heron has no "
                                         r"parameter for \(model.layers.0.mlp.down_proj"):
        LLM(str(ckpt.dir))


def test_autogptq_side_file_is_read(ckpt):
    (ckpt.dir / "quantize_config.json").write_text(json.dumps({"bits": 3, "group_size": 64}))
    with pytest.raises(ValueError, match=r"GPTQ with 3 bits is not supported"):
        LLM(str(ckpt.dir))


def test_unknown_quantization_method_is_refused(ckpt):
    ckpt.edit_config(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match=r"quantization method 'bitsandbytes' is not supported"):
        LLM(str(ckpt.dir))


@pytest.mark.parametrize("qc, expected", [
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "int"},
              "input_activations": {"num_bits": 8, "type": "int"}}}},
     "format 'int-quantized', scheme W8A8 INT8"),
    ({"quant_method": "compressed-tensors", "config_groups": {
        "g": {"format": "pack-quantized", "weights": {"num_bits": 4, "type": "int"}}}},
     "format 'pack-quantized', scheme W4A16 INT4"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
     "quant_method='awq', bits=4, group_size=128"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
     "quant_method='fp8', fmt=e4m3, weight_block_size=[128, 128]"),
])
def test_quantization_is_named(qc, expected):
    assert expected in describe_quantization(qc)


def test_quantization_tensors_without_config_are_refused(ckpt):
    ckpt.edit_tensors(_add_weight_scales)
    with pytest.raises(ValueError, match=r"checkpoint has 14 tensors .* weight_scale hold "
                                         r"quantization data: the checkpoint looks quantized"):
        LLM(str(ckpt.dir))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_non_float_weight_is_refused(ckpt, dtype):
    name = "model.layers.0.mlp.down_proj.weight"
    ckpt.edit_tensors(lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(ValueError, match=f"{name} has dtype {dtype}: the checkpoint looks "
                                         f"quantized; a quantized checkpoint needs"):
        LLM(str(ckpt.dir))


def test_unexpected_tensor_is_refused(ckpt):
    name = "model.layers.0.mlp.extra.weight"
    ckpt.edit_tensors(lambda t: t.update({name: torch.zeros(4, 4)}))
    with pytest.raises(ValueError, match=rf"checkpoint has 1 tensor heron has no parameter for "
                                         rf"\({name}\)"):
        LLM(str(ckpt.dir))


def test_rotary_caches_are_accepted(ckpt, tiny):
    def add(tensors):
        for i in range(2):
            prefix = f"model.layers.{i}.self_attn.rotary_emb."
            tensors[prefix + "inv_freq"] = torch.ones(8)
            tensors[prefix + "cos_cached"] = torch.ones(4, 16)
            tensors[prefix + "sin_cached"] = torch.zeros(4, 16)

    ckpt.edit_tensors(add)
    out = LLM(str(ckpt.dir)).generate([PROMPT], SamplingParams(temperature=0, max_tokens=6,
                                                               ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(tiny.hf, PROMPT, 6)[0]


def test_gguf_with_undequantizable_type_is_refused(tmp_path):
    path = tmp_path / "int.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_context_length, 64),
                   (w.add_embedding_length, 32), (w.add_feed_forward_length, 64),
                   (w.add_head_count, 2), (w.add_vocab_size, 16)]:
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.int8))
    w.add_tensor("blk.0.attn_k.weight", np.zeros((32, 32), dtype=np.float64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"ggml types heron cannot dequantize: "
                                         r"F64 \(e.g. blk.0.attn_k.weight\), "
                                         r"I8 \(e.g. blk.0.attn_q.weight\)"):
        read_gguf_config(path)
