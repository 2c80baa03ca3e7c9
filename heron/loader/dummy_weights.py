"""Random weights for a model built from its config alone (``load_format="dummy"``).

Throughput and latency depend on shapes, not on values, so large models can be benchmarked
without downloading their checkpoints. Norm scales are set to 1 and biases to 0 so that
activations keep the magnitudes of a trained model; matrices are drawn from N(0, std).

A quantized model gets its method's checkpoint parameters filled the same way, by dtype:
packed integers with random bits (any pattern is valid packing), fp8 from N(0, std), scales
positive; optional parameters (GPTQ's ``g_idx``) stay absent, as in a checkpoint without
them. ``process_weights_after_loading`` then repacks them as a real checkpoint's would, so a
W4A16 or FP8 model of any shape can be timed without a checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.layers.norm import RMSNorm
from heron.quant.base import UnquantizedLinearMethod

DUMMY_STD = 0.02


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Overwrite every parameter of ``model`` in place, deterministically for a given seed
    and device. Tied parameters are filled once (they are the same tensor)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if _is_quantized(module):
                continue
            if isinstance(module, RMSNorm):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
    for module in model.modules():
        if _is_quantized(module):
            _fill_quantized(module, generator, std)


def _is_quantized(module: nn.Module) -> bool:
    method = getattr(module, "quant_method", None)
    return method is not None and not isinstance(method, UnquantizedLinearMethod)


def _fill_quantized(layer: nn.Module, generator: torch.Generator, std: float) -> None:
    """One quantized linear layer's checkpoint parameters, marked loaded."""
    for name, param in layer.named_parameters(recurse=False):
        if name in layer.optional_params:
            continue
        if name == "bias":
            param.zero_()
        elif not param.dtype.is_floating_point:
            info = torch.iinfo(param.dtype)
            param.copy_(torch.randint(info.min, info.max, param.shape, generator=generator,
                                      device=param.device, dtype=torch.int64).to(param.dtype))
        elif "scale" in name:  # weight scales and input scales: positive, ~ std per level
            param.uniform_(0.5 * std, 1.5 * std, generator=generator)
        else:  # float weights (quantized on load) and fp8 weights
            param.copy_(torch.empty(param.shape, device=param.device).normal_(
                0.0, std, generator=generator).to(param.dtype))
        layer.loaded_params.add(name)
