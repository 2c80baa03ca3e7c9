"""Save and load an ``EagleHead``: a directory with ``config.json`` and ``model.safetensors``.

``config.json``::

    {"format": "heron-eagle-head", "version": 1,
     "architecture": "LlamaForCausalLM",          # the TARGET's architecture
     "hidden_size": 576, "vocab_size": 49152, "num_heads": 9, "num_kv_heads": 3,
     "head_dim": 64, "intermediate_size": 1536, "rms_norm_eps": 1e-05,
     "rope_theta": 100000.0, "rope_scaling": null, "sliding_window": null,
     "qkv_bias": false, "qk_norm": false, "dtype": "float32",
     "training": {...}}                           # free-form: data, steps, loss, accuracy

``model.safetensors`` holds the head's own weights only, unfused and in HF-style names, so
heron's loader (``heron.loader.weights.load_weights``) fills the fused parameters, and would
shard them under tensor parallelism::

    fc.weight                                   (H, 2H)   input [embed ; target_hidden]
    layer.input_layernorm.weight                (H,)
    layer.self_attn.{q,k,v}_proj.weight         (heads*D, H), (kv_heads*D, H) x2
    layer.self_attn.{q,k,v}_proj.bias           only when qkv_bias
    layer.self_attn.{q,k}_norm.weight           (D,) only when qk_norm
    layer.self_attn.o_proj.weight               (H, heads*D)
    layer.post_attention_layernorm.weight       (H,)
    layer.mlp.{gate,up}_proj.weight             (I, H)
    layer.mlp.down_proj.weight                  (H, I)
    norm.weight                                 (H,)

No embedding and no LM head: those are the target's. ``load_eagle_head`` checks the config
against the target's ``ModelArchConfig`` and raises ValueError on any mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from heron.models import ModelArchConfig
from heron.speculative.eagle_head import EagleHead, build_eagle_head, target_attention_flags

FORMAT = "heron-eagle-head"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# config.json key -> ModelArchConfig field that must match the target
_MATCHED = {"hidden_size": "hidden_size", "vocab_size": "vocab_size", "num_heads": "num_heads",
            "num_kv_heads": "num_kv_heads", "head_dim": "head_dim",
            "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
            "rope_theta": "rope_theta", "rope_scaling": "rope_scaling",
            "sliding_window": "sliding_window"}


def head_config(head: EagleHead, meta: dict | None = None) -> dict:
    """The ``config.json`` dict of ``head`` (``meta``: the free-form "training" entry)."""
    cfg = head.config
    out = {"format": FORMAT, "version": VERSION, "architecture": cfg.architecture}
    out.update({key: getattr(cfg, field) for key, field in _MATCHED.items()})
    out.update(qkv_bias=head.qkv_bias, qk_norm=head.qk_norm,
               dtype=str(head.fc.weight.dtype).removeprefix("torch."), training=meta or {})
    return out


def _unfused_state(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's parameters under checkpoint names: fused qkv / gate_up split back."""
    split_into: dict[str, list[str]] = {}  # fused module name -> projections by shard
    for proj, (fused, shard) in sorted(head.packed_modules.items(), key=lambda kv: kv[1]):
        split_into.setdefault(fused, []).append(proj)
    out: dict[str, torch.Tensor] = {}
    for name, param in head.named_parameters():
        module_path, attr = name.rsplit(".", 1)
        parent, _, module_name = module_path.rpartition(".")
        module = head.get_submodule(module_path)
        if module_name not in split_into:
            out[name] = param.detach()
            continue
        if getattr(module, "tp_size", 1) != 1:
            raise ValueError("saving a tensor-parallel shard of an EAGLE head is not "
                             "supported: save from a single-rank head")
        for proj, part in zip(split_into[module_name],
                              param.detach().split(module.output_sizes, dim=0)):
            out[f"{parent}.{proj}.{attr}"] = part
    return {k: v.contiguous().cpu() for k, v in out.items()}


def save_eagle_head(head: EagleHead, path: str | Path, meta: dict | None = None) -> Path:
    """Write ``head`` to the directory ``path`` (created): config.json + model.safetensors."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_unfused_state(head), str(path / WEIGHTS_FILE), metadata={"format": FORMAT})
    (path / CONFIG_FILE).write_text(json.dumps(head_config(head, meta), indent=2) + "\n")
    return path


def read_head_config(path: str | Path) -> dict:
    """The checked ``config.json`` of the checkpoint directory ``path``."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (needs {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (config.json format "
                         f"{config.get('format') if isinstance(config, dict) else None!r})")
    if config.get("version") != VERSION:
        raise ValueError(f"{path}: {FORMAT} version {config.get('version')!r} is not "
                         f"supported (this heron reads version {VERSION})")
    return config


def check_matches_target(config: dict, target_arch: ModelArchConfig) -> None:
    """ValueError naming every field where the head's config and the target differ."""
    bad = []
    if config.get("architecture") != target_arch.architecture:
        bad.append(f"architecture: head {config.get('architecture')!r}, "
                   f"target {target_arch.architecture!r}")
    for key, field in _MATCHED.items():
        want, got = getattr(target_arch, field), config.get(key)
        same = (abs(float(got) - float(want)) <= 1e-6 * abs(float(want))
                if isinstance(want, float) and isinstance(got, (int, float)) else got == want)
        if not same:
            bad.append(f"{key}: head {got!r}, target {want!r}")
    qkv_bias, qk_norm = target_attention_flags(target_arch)
    for key, want in (("qkv_bias", qkv_bias), ("qk_norm", qk_norm)):
        if config.get(key) != want:
            bad.append(f"{key}: head {config.get(key)!r}, target {want!r}")
    if bad:
        raise ValueError("this EAGLE head was trained for another target: " + "; ".join(bad))


def load_eagle_head(path: str | Path, target_arch: ModelArchConfig,
                    dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> EagleHead:
    """The head saved in ``path`` for the target ``target_arch``, on ``device`` in ``dtype``
    (eval mode, gradients off). ValueError when ``path`` is not this format, was trained
    for a target of other shapes, or its weights do not fill the head exactly."""
    from heron.loader.safetensors_weights import iter_safetensors
    from heron.loader.weights import load_weights

    config = read_head_config(path)
    check_matches_target(config, target_arch)
    head = build_eagle_head(target_arch, dtype, device, seed=None)
    load_weights(head, iter_safetensors([Path(path) / WEIGHTS_FILE]), dtype)
    return head
