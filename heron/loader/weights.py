"""Build a model on the meta device and load checkpoint tensors through its parameters."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from heron.layers.embedding import LMHead
from heron.layers.linear import Linear, default_weight_loader
from heron.loader import checkpoint_checks as checks
from heron.models import ModelArchConfig, get_model_class


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _route(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """HF tensor name -> (heron parameter name, shard index of a fused parameter or None)."""
    for hf_proj, (fused, shard) in packed.items():
        token = f".{hf_proj}."
        if token in name:
            return name.replace(token, f".{fused}."), shard
    return name, None


def build_model(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Instantiate without allocating (meta), then materialise uninitialised on ``device``."""
    cls = get_model_class(arch.architecture)
    with torch.device("meta"), _default_dtype(dtype):
        model = cls(arch)
    model.to_empty(device=device)
    if arch.tie_word_embeddings:  # to_empty gives each module its own copy: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_weights(model: nn.Module, weights, dtype: torch.dtype) -> None:
    """Copy every checkpoint tensor into its parameter.

    Fails (ValueError) on a parameter the checkpoint lacks, on a tensor that is not plain
    floating point, and on checkpoint tensors with no matching parameter unless known harmless
    (rotary caches, the tied lm_head.weight): see checkpoint_checks.
    """
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    tied = model.config.tie_word_embeddings
    expected = {name: len(getattr(_owner(model, name), "output_sizes", [None]))
                for name in params if not (tied and name == "lm_head.weight")}
    loaded: dict[str, set] = {}
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        if checks.is_harmless(hf_name) or (tied and hf_name == "lm_head.weight"):
            continue
        name, shard = _route(hf_name, packed)
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        checks.check_dtype(hf_name, tensor)
        loader = getattr(_owner(model, name), "load_weight", default_weight_loader)
        loader(param, tensor.to(dtype), shard)
        loaded.setdefault(name, set()).add(shard)
    if unexpected:
        raise checks.unexpected_tensors_error(unexpected)
    missing = [n for n, shards in expected.items() if len(loaded.get(n, ())) < shards]
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


def materialize_weights(model: nn.Module, source, load_format: str, dtype: torch.dtype,
                        seed: int = 0) -> None:
    """Fill a built model's parameters: from ``source``'s checkpoint (``load_format="auto"``)
    or with random values from the config alone (``"dummy"``; see dummy_weights)."""
    if load_format == "dummy":
        from heron.loader.dummy_weights import init_dummy_weights

        init_dummy_weights(model, seed)
    elif load_format == "auto":
        load_weights(model, source.weights(), dtype)
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")


def optimize_layout(model: nn.Module, device: torch.device) -> None:
    """On CPU, store projection weights column-major (a transposed view of a contiguous
    (in, out) buffer): MKL's batch-1 GEMV then streams weights about 2x faster, which is what
    bounds single-sequence decode, at a few percent cost for large batches."""
    if device.type != "cpu":
        return
    for module in model.modules():
        if isinstance(module, (Linear, LMHead)):
            module.weight.data = module.weight.data.t().contiguous().t()
    if model.config.tie_word_embeddings:
        model.model.embed_tokens.weight = model.lm_head.weight


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])
