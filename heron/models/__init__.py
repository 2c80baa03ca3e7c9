"""Model registry: HF ``architectures`` name -> heron model class."""

from __future__ import annotations

from torch import nn

from heron.models.config import ModelArchConfig
from heron.models.gemma3 import Gemma3ForCausalLM
from heron.models.llama import LlamaForCausalLM, MistralForCausalLM
from heron.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


# architectures heron knows and refuses, with the reason
REFUSED_ARCHITECTURES: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "Gemma 3 multimodal (vision) checkpoints are not "
    "supported: heron runs text-only Gemma 3 (Gemma3ForCausalLM checkpoints, or the GGUF "
    "files of the text model)",
}


def get_model_class(arch: str) -> type[nn.Module]:
    if arch in REFUSED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}: {REFUSED_ARCHITECTURES[arch]}")
    try:
        return MODEL_REGISTRY[arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch!r}; heron supports: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None


__all__ = ["ModelArchConfig", "MODEL_REGISTRY", "get_model_class"]
