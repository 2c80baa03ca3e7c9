"""Where a model comes from: an HF directory, a GGUF file, or the embedded default."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from heron.loader import safetensors_weights
from heron.loader.lazy_tensor import ReadCounter
from heron.quant.config import checkpoint_quantization

WeightsFn = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class ModelSource:
    """A resolved model: its HF-style config, a weight iterator, and a tokenizer directory."""

    name: str
    hf_config: dict
    weights: WeightsFn
    tokenizer_dir: Path | None
    generation_config: dict
    # bytes the weight iterator read from checkpoint files (safetensors are read lazily:
    # a tensor-parallel rank reads only its shards)
    read_counter: ReadCounter = field(default_factory=ReadCounter)
    # the checkpoint's quantization_config (or AutoGPTQ / AutoAWQ side file), if any
    quantization: dict | None = None
    # GGUF files only: the weights with quantized matrices kept quantized
    quantized_weights: WeightsFn | None = None

    @property
    def is_gguf(self) -> bool:
        return self.quantized_weights is not None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _no_weights() -> Iterator[tuple[str, torch.Tensor]]:
    raise ValueError("this model was resolved with load_format='dummy': it has no weights")


def merge_overrides(config: dict, overrides: dict | None) -> dict:
    """``config`` with ``overrides`` merged in (``--hf-overrides``): a nested object merges
    into the same key's object recursively, any other value replaces it. A new dict."""
    merged = dict(config)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def _from_hf_dir(path: Path, load_format: str, overrides: dict | None) -> ModelSource:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    hf_config = merge_overrides(_read_json(config_path), overrides)
    if load_format == "dummy":  # random weights: config.json is all that is needed
        weights = _no_weights
    else:
        files = safetensors_weights.find_safetensors(path)
        counter = ReadCounter()
        weights = lambda: safetensors_weights.iter_safetensors(files, counter)  # noqa: E731
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                       "tokenizer_config.json"))
    return ModelSource(
        name=str(path),
        hf_config=hf_config,
        weights=weights,
        tokenizer_dir=path if has_tokenizer else None,
        generation_config=_read_json(path / "generation_config.json"),
        quantization=checkpoint_quantization(hf_config, path),
        **({"read_counter": counter} if load_format != "dummy" else {}),
    )


def _gguf_loader():
    """The GGUF loader, imported on first use so that HF directories load without `gguf`."""
    try:
        from heron.loader import gguf_loader
    except ImportError as e:
        raise ImportError(f"reading GGUF files needs the `gguf` package ({e}); "
                          f"pip install gguf, or pass a Hugging Face model directory") from e
    return gguf_loader


def _from_gguf(path: Path, overrides: dict | None) -> ModelSource:
    gguf_loader = _gguf_loader()

    config = merge_overrides(gguf_loader.read_gguf_config(path), overrides)
    tokenizer_dir = gguf_loader.prepare_gguf_tokenizer_dir(path)
    return ModelSource(
        name=str(path),
        hf_config=config,
        weights=lambda: gguf_loader.iter_gguf_weights(path, config),
        quantized_weights=lambda: gguf_loader.iter_gguf_weights(path, config, True),
        tokenizer_dir=tokenizer_dir,
        generation_config=_read_json(tokenizer_dir / "generation_config.json"),
    )


def resolve_model(model: str | None, load_format: str = "auto",
                  hf_overrides: dict | None = None) -> ModelSource:
    """Resolve ``model`` (None = the embedded SmolLM2-135M-Instruct GGUF).

    With ``load_format="dummy"`` an HF directory needs only its config.json; the returned
    source then has no weights (the engine fills the model with random values).
    ``hf_overrides`` is merged into the config (``merge_overrides``) before anything reads it.
    """
    if model is None:
        return _from_gguf(_gguf_loader().find_default_gguf(), hf_overrides)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: pass a Hugging Face model directory or a .gguf file "
            f"(no model hub is contacted)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{model!r} is a file but not a .gguf file")
        return _from_gguf(path, hf_overrides)
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").is_file() and len(ggufs) == 1:
        return _from_gguf(ggufs[0], hf_overrides)
    return _from_hf_dir(path, load_format, hf_overrides)
