"""Build a model on the meta device and load checkpoint tensors through its parameters."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from heron.distributed import get_pp_group
from heron.distributed.pipeline import MissingLayer
from heron.layers.cpu_gemm import use_cpu_gemm
from heron.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from heron.layers.linear import ReplicatedLinear, default_weight_loader
from heron.loader import checkpoint_checks as checks
from heron.logging_config import progress
from heron.models import ModelArchConfig, get_model_class
from heron.quant.base import UnquantizedEmbeddingMethod, UnquantizedLinearMethod
from heron.quant.config import QuantizationConfig
from heron.quant.gguf_blocks import QuantizedRows


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


def build_model(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                quantization: QuantizationConfig | None = None) -> nn.Module:
    """Instantiate without allocating (meta), give each linear layer its quantization
    method, then materialise uninitialised on ``device``."""
    cls = get_model_class(arch.architecture)
    with torch.device("meta"), _default_dtype(dtype):
        model = cls(arch)
        if quantization is not None:
            _set_quant_methods(model, quantization, dtype)
    model.to_empty(device=device)
    _retie(model)  # to_empty gives each module its own copy
    return model.eval()


def _hf_module_names(model: nn.Module, module_name: str) -> list[str]:
    """The HF modules a heron layer fuses (qkv_proj -> q_proj, k_proj, v_proj)."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = [hf for hf, (fused, _) in getattr(model, "packed_modules", {}).items()
             if fused == leaf]
    return [f"{prefix}.{hf}" for hf in parts] or [module_name]


def _set_quant_methods(model: nn.Module, quantization: QuantizationConfig,
                       dtype: torch.dtype) -> None:
    for name, module in model.named_modules():
        if isinstance(module, ReplicatedLinear):
            method = quantization.linear_method(_hf_module_names(model, name))
            if method is not None:
                module.set_quant_method(method, dtype)


def _retie(model: nn.Module) -> None:
    """Share the embedding table with the LM head again (when this stage has both)."""
    if model.config.tie_word_embeddings and hasattr(model, "lm_head") and \
            hasattr(model.model, "embed_tokens"):
        model.lm_head.weight = model.model.embed_tokens.weight


def load_weights(model: nn.Module, weights, dtype: torch.dtype) -> None:
    """Copy every checkpoint tensor into its parameter (cast to ``dtype`` by the copy); each
    layer's loader narrows a tensor to this rank's shard before it is read.

    Fails (ValueError) on a parameter the checkpoint lacks, on a tensor that is not plain
    floating point, and on checkpoint tensors with no matching parameter unless known harmless
    (rotary caches, the tied lm_head.weight) or owned by another pipeline stage: see
    checkpoint_checks.
    """
    params = dict(model.named_parameters())  # a tied lm_head shares the embedding's entry
    packed = getattr(model, "packed_modules", {})
    tied = model.config.tie_word_embeddings
    expected = {name: len(getattr(_owner(model, name), "output_sizes", [None]))
                for name in params if not _is_optional(model, name)}
    loaded: dict[str, set] = {}
    unexpected: list[str] = []
    for hf_name, tensor in progress(weights, desc="loading weights", unit=" tensors"):
        if checks.is_harmless(hf_name) or (tied and hf_name == "lm_head.weight"):
            continue
        name, shard = _route(hf_name, packed)
        if tied and name == "model.embed_tokens.weight" and name not in params:
            name = "lm_head.weight"  # a last pipeline stage's own copy of the tied table
        param = params.get(name)
        if param is None:
            if not _on_other_stage(model, name):
                unexpected.append(hf_name)
            continue
        owner = _owner(model, name)
        if isinstance(tensor, QuantizedRows) or _decodes_while_loading(owner):
            pass  # GGUF rows, or a float projection of a GGUF layer: the layer decides
        elif param.dtype.is_floating_point and param.dtype.itemsize > 1:
            checks.check_dtype(hf_name, tensor)  # a quantized tensor for a float parameter
        else:
            checks.check_quantized_dtype(hf_name, tensor, param.dtype)
        loader = getattr(owner, "load_weight", default_weight_loader)
        loader(param, tensor, shard)
        loaded.setdefault(name, set()).add(shard)
    if unexpected:
        raise checks.unexpected_tensors_error(unexpected)
    missing = [n for n, shards in expected.items() if len(loaded.get(n, ())) < shards]
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


def _decodes_while_loading(layer: nn.Module) -> bool:
    """Whether ``layer``'s quantization method takes checkpoint tensors as they come and
    checks them itself (GGUF kept quantized: a fused layer may mix float projections with
    quantized ones)."""
    return hasattr(getattr(layer, "quant_method", None), "load_weight")


def _is_optional(model: nn.Module, param_name: str) -> bool:
    return param_name.rsplit(".", 1)[-1] in getattr(_owner(model, param_name),
                                                    "optional_params", ())


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each layer's method repack what it loaded; a tied LM head shares the embedding's
    table and its method (a GGUF table kept quantized included)."""
    for module in model.modules():
        if isinstance(module, ReplicatedLinear):
            module.quant_method.process_weights_after_loading(module)
    _retie(model)
    if model.config.tie_word_embeddings and hasattr(model, "lm_head") and \
            hasattr(model.model, "embed_tokens"):
        model.lm_head.quant_method = model.model.embed_tokens.quant_method


def _on_other_stage(model: nn.Module, param_name: str) -> bool:
    """The parameter belongs to a module another pipeline stage builds (a layer, the
    embedding, the final norm or the LM head)."""
    if get_pp_group().world_size == 1:
        return False
    path = param_name.rsplit(".", 1)[0]
    module = model
    for part in path.split("."):
        if isinstance(module, MissingLayer):
            return True
        if not hasattr(module, part):
            return part in ("embed_tokens", "norm", "lm_head")
        module = getattr(module, part)
    return isinstance(module, MissingLayer)


def materialize_weights(model: nn.Module, source, load_format: str, dtype: torch.dtype,
                        seed: int = 0, quantization: QuantizationConfig | None = None) -> None:
    """Fill a built model's parameters: from ``source``'s checkpoint (``load_format="auto"``;
    a GGUF file's quantized matrices kept quantized under the ``gguf`` method) or with random
    values from the config alone (``"dummy"``; see dummy_weights)."""
    if load_format == "dummy":
        from heron.loader.dummy_weights import init_dummy_weights

        if quantization is not None and quantization.method == "gguf":
            raise ValueError("random (dummy) weights need an HF config, not a GGUF file")
        init_dummy_weights(model, seed)
        process_weights_after_loading(model)
    elif load_format == "auto":
        keep = quantization is not None and quantization.keeps_embedding_quantized
        load_weights(model, (source.quantized_weights if keep else source.weights)(), dtype)
        process_weights_after_loading(model)
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")


_PLAIN_METHODS = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


def optimize_layout(model: nn.Module, device: torch.device) -> None:
    """On CPU, keep each float32 projection weight (linear layers, the LM head) in two layouts
    behind a ``layers.cpu_gemm.CpuGemmMethod``: column-major (a transposed view of a
    contiguous (in, out) buffer), which MKL's GEMV streams fastest and which bounds
    single-sequence decode, and oneDNN's packed layout for steps of several rows. Without
    oneDNN (or for other dtypes) only the column-major one, under the plain method. Layers
    with any other method (quantized; already prepared) keep theirs."""
    if device.type != "cpu":
        return
    for module in model.modules():
        if isinstance(module, (ReplicatedLinear, ParallelLMHead)) and \
                type(module.quant_method) in _PLAIN_METHODS:
            use_cpu_gemm(module)
    _retie(model)


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of this rank's weights in the form the forward reads them: quantized layers at
    their packed size (a tied table counted once; CpuGemm's second copy not counted)."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, ReplicatedLinear):
            total += module.quant_method.weight_bytes(module)
            params = [module.bias] if module.bias is not None else []
        elif isinstance(module, VocabParallelEmbedding):
            params = []
            if id(module.weight) not in seen:  # a tied table (and its method) once
                seen.add(id(module.weight))
                total += module.quant_method.weight_bytes(module)
        else:
            params = list(module.parameters(recurse=False))
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])
