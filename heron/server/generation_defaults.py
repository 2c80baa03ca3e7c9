"""Sampling defaults from a model's generation_config.json, as vLLM's ``--generation-config``
and ``--override-generation-config`` make them: a request that leaves a field unset gets the
model's value instead of OpenAI's default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from heron.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field (vLLM's list: the keys it applies)
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "max_new_tokens": "max_tokens"}


def _read(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def source_folder(mode: str, model: str | None) -> Path | None:
    """Where ``--generation-config MODE`` reads generation_config.json from: ``auto`` the
    model's directory (a GGUF file or the embedded model has none with sampling values),
    ``vllm`` nowhere, anything else a folder that must exist."""
    if mode == "vllm":
        return None
    if mode == "auto":
        return Path(model) if model is not None and Path(model).is_dir() else None
    folder = Path(mode)
    if not folder.is_dir():
        raise FileNotFoundError(f"--generation-config {mode}: no such folder (give 'auto', "
                                f"'vllm' or a folder holding generation_config.json)")
    return folder


def sampling_defaults(mode: str, model: str | None,
                      overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams fields the model's generation config (then ``overrides``) sets; checked
    now, so that a bad value fails at startup and not in every request."""
    folder = source_folder(mode, model)
    config = _read(folder) if folder is not None else {}
    unknown = sorted(set(overrides or {}) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(unknown)}; "
                         f"heron applies {', '.join(GENERATION_KEYS)}")
    config = {**config, **(overrides or {})}
    defaults = {field: config[key] for key, field in GENERATION_KEYS.items()
                if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation config sampling defaults {defaults}: {e}") from None
    return defaults
