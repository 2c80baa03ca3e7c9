"""Model registry: HF ``architectures`` name -> heron model class."""

from __future__ import annotations

from torch import nn

from heron.models.config import ModelArchConfig
from heron.models.llama import LlamaForCausalLM, MistralForCausalLM
from heron.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(arch: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch!r}; heron supports: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None


__all__ = ["ModelArchConfig", "MODEL_REGISTRY", "get_model_class"]
