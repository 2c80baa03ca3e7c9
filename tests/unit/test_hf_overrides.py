"""--hf-overrides (merged into config.json, carried as plain data) and the --max-model-len
check against what the model's rope covers."""

from __future__ import annotations

import json

import msgspec
import pytest

from heron.config import EngineConfig
from heron.entrypoints.cli import build_parser, main
from heron.loader.model_source import merge_overrides, resolve_model
from heron.models.config import ModelArchConfig
from heron.models.context_length import check_max_model_len, prefix_caching_allowed

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def test_merge_is_recursive_and_leaves_the_config_alone():
    cfg = {"a": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "b": {"c": 1}}
    merged = merge_overrides(cfg, {"rope_parameters": {"rope_type": "linear", "factor": 2.0},
                                   "b": 3, "d": {"e": 1}})
    assert merged == {"a": 1, "b": 3, "d": {"e": 1}, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}}
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert merge_overrides(cfg, None) == cfg


def test_engine_config_parses_and_carries_the_overrides():
    config = EngineConfig(hf_overrides=json.dumps({"rope_scaling": YARN}))
    assert config.hf_overrides == {"rope_scaling": YARN}
    # the worker processes get the same dict (the config crosses as msgpack)
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    assert again.hf_overrides == {"rope_scaling": YARN}
    assert EngineConfig(hf_overrides="{}").hf_overrides is None
    with pytest.raises(ValueError, match="--hf-overrides is not valid JSON"):
        EngineConfig(hf_overrides="{rope_scaling: 1")
    with pytest.raises(ValueError, match="must be a JSON object"):
        EngineConfig(hf_overrides="[1, 2]")


def test_resolve_model_applies_the_overrides(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}))
    source = resolve_model(str(tmp_path), "dummy", {"rope_parameters": YARN})
    assert source.hf_config["rope_parameters"] == {**YARN, "rope_theta": 1e4}
    assert resolve_model(str(tmp_path), "dummy").hf_config["rope_parameters"]["rope_type"] == \
        "default"


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"],
                                     ["bench", "throughput"], ["bench", "latency"]])
def test_every_model_command_takes_the_flag(command):
    args = build_parser().parse_args([*command, "--hf-overrides", '{"a": 1}'])
    assert args.hf_overrides == '{"a": 1}'


def test_bad_json_is_one_clear_line(capsys):
    assert main(["generate", "hi", "--hf-overrides", "{bad"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if " INFO " not in line]
    assert len(err) == 1 and "--hf-overrides is not valid JSON" in err[0]


def _arch(**cfg) -> ModelArchConfig:
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=64,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=64)
    return ModelArchConfig.from_hf({**base, **cfg})


def test_max_model_len_beyond_the_native_length():
    plain = _arch()
    check_max_model_len(plain, None)
    check_max_model_len(plain, 64)
    with pytest.raises(ValueError) as exc:
        check_max_model_len(plain, 200)
    message = str(exc.value)
    assert "--max-model-len 200 exceeds" in message and "at most 64" in message
    assert "--hf-overrides '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, " \
           "\"original_max_position_embeddings\": 64}}'" in message
    # the suggested override is enough
    suggested = json.loads(message.split("--hf-overrides '")[1].split("'")[0])
    check_max_model_len(_arch(**suggested), 200)
    for scaling in (YARN, {"rope_type": "dynamic", "factor": 4.0},
                    {"rope_type": "linear", "factor": 4.0},
                    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}):
        for key in ("rope_scaling", "rope_parameters"):
            arch = _arch(**{key: scaling})
            check_max_model_len(arch, 256)
            with pytest.raises(ValueError, match=f"its {scaling['rope_type']} rope scaling "
                                                 f"covers 256") as exc:
                check_max_model_len(arch, 300)
            # the suggestion raises the model's own factor, under the key the config uses
            fix = json.loads(str(exc.value).split("--hf-overrides '")[1].split("'")[0])
            assert fix == {key: {"factor": 5.0}}
            check_max_model_len(_arch(**merge_overrides(arch.hf_config, fix)), 300)
    # longrope: original length x factor (here derived from max_position_embeddings)
    longrope = _arch(max_position_embeddings=512, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
        "original_max_position_embeddings": 64})
    check_max_model_len(longrope, 512)
    with pytest.raises(ValueError, match="covers 512"):
        check_max_model_len(longrope, 513)


def test_any_length_when_queries_see_a_covered_window_only():
    """Every layer sliding over a window the positions cover, or StreamingLLM: a query sees
    at most that many positions, so the context is not bounded by the trained length."""
    check_max_model_len(_arch(sliding_window=32), 100_000)
    check_max_model_len(_arch(), 100_000, streaming_kv=(4, 32))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        check_max_model_len(_arch(sliding_window=32, layer_types=["full_attention",
                                                                  "sliding_attention"]), 200)
    with pytest.raises(ValueError, match="streaming_kv keeps"):
        check_max_model_len(_arch(), 200, streaming_kv=(4, 64))


def test_prefix_caching_off_for_length_dependent_rope():
    assert prefix_caching_allowed(_arch(rope_scaling=YARN), True)
    assert not prefix_caching_allowed(_arch(rope_scaling={"rope_type": "dynamic",
                                                          "factor": 2.0}), True)
    assert not prefix_caching_allowed(_arch(), False)
