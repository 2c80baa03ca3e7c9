"""Which quantization a model loads with: read from the checkpoint (config.json's
``quantization_config``, or AutoGPTQ / AutoAWQ side files), or chosen with
``--quantization`` (vLLM's names), and which ``LinearMethod`` each layer gets.

* ``gptq`` / ``awq`` / ``compressed-tensors``: the checkpoint's own format (an override must
  agree with it); ``gptq_marlin`` / ``awq_marlin`` are accepted as vLLM spells them.
* ``gguf``: a GGUF file's quantized tensors kept quantized (the default on CPU).
* ``fp8``: an unquantized checkpoint quantized to FP8 per channel as it loads (dynamic
  per-token activations), or an FP8 compressed-tensors checkpoint.
* ``none``: a GGUF file dequantized to the model dtype (heron's behaviour before).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from heron.quant import QUANTIZATION_CHOICES
from heron.quant.base import LinearMethod
from heron.quant.methods.activation_quant import FP8LinearMethod
from heron.quant.methods.awq import AWQConfig, AWQLinearMethod
from heron.quant.methods.compressed_tensors import CompressedTensorsConfig
from heron.quant.methods.gguf import GGUFLinearMethod
from heron.quant.methods.gptq import GPTQConfig, GPTQLinearMethod

_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors":
            "compressed-tensors"}
_SIDE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


@dataclass(frozen=True)
class QuantizationConfig:
    """The method name and its format's parsed config (None for gguf and online fp8)."""

    method: str
    format_config: Any = None
    not_converted: tuple[str, ...] = ()  # module name fragments left in float (AWQ, GPTQ)

    @property
    def keeps_embedding_quantized(self) -> bool:
        return self.method == "gguf"

    def linear_method(self, module_names: list[str]) -> LinearMethod | None:
        """The method for the layer fusing these HF modules (None: unquantized)."""
        if self.method == "compressed-tensors":
            return self.format_config.linear_method(module_names)
        if any(frag in name for name in module_names for frag in self.not_converted):
            return None
        if self.method == "gptq":
            return GPTQLinearMethod(self.format_config)
        if self.method == "awq":
            return AWQLinearMethod(self.format_config)
        if self.method == "gguf":
            return GGUFLinearMethod()
        return FP8LinearMethod("channel", "dynamic", quantize_on_load=True)

    def describe(self) -> str:
        if self.format_config is not None:
            return self.format_config.describe()
        return {"gguf": "gguf (kept quantized)",
                "fp8": "fp8 per-channel (quantized at load), dynamic per-token "
                       "activations"}[self.method]


def checkpoint_quantization(hf_config: dict, path: Path | None) -> dict | None:
    """The quantization config a checkpoint declares, with ``quant_method`` set."""
    qc = hf_config.get("quantization_config")
    if qc:
        return dict(qc)
    for name, method in _SIDE_FILES.items():
        if path is not None and (path / name).is_file():
            return {"quant_method": method, **json.loads((path / name).read_text())}
    return None


def _from_checkpoint(qc: dict) -> QuantizationConfig:
    method = _ALIASES.get(str(qc.get("quant_method", "")).lower(),
                          str(qc.get("quant_method", "")).lower())
    if method == "gptq":
        if qc.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        return QuantizationConfig("gptq", GPTQConfig.from_dict(qc),
                                  tuple(qc.get("modules_to_not_convert") or ()))
    if method == "awq":
        return QuantizationConfig("awq", AWQConfig.from_dict(qc),
                                  tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return QuantizationConfig("compressed-tensors", CompressedTensorsConfig.from_dict(qc))
    raise ValueError(f"quantization method {qc.get('quant_method')!r} is not supported; "
                     f"heron loads gptq, awq and compressed-tensors checkpoints")


def resolve_quantization(checkpoint_qc: dict | None, is_gguf: bool, requested: str | None,
                         device_type: str = "cpu") -> QuantizationConfig | None:
    """The quantization to load with (None: unquantized), or a ValueError when the request
    does not fit the checkpoint."""
    requested = None if requested in (None, "auto") else _ALIASES.get(requested, requested)
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {requested!r}; choose one of "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    if is_gguf:
        if requested in (None, "gguf"):
            return QuantizationConfig("gguf") if requested or device_type == "cpu" else None
        if requested == "none":
            return None
        raise ValueError(f"a GGUF file loads with --quantization gguf (kept quantized) or "
                         f"none (dequantized), not {requested!r}")
    if checkpoint_qc:
        found = _from_checkpoint(checkpoint_qc)
        if requested not in (None, found.method):
            raise ValueError(f"the checkpoint is quantized with {found.method}; "
                             f"--quantization {requested} does not match it")
        return found
    if requested in (None, "none"):
        return None
    if requested == "fp8":
        return QuantizationConfig("fp8")
    raise ValueError(f"--quantization {requested} needs a {requested} checkpoint; this one "
                     f"is not quantized (heron quantize writes one)")
