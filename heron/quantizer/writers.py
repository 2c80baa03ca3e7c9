"""Published checkpoint formats: one quantized linear -> its tensors, the method's
``quantization_config``, the directory (config.json, model.safetensors, tokenizer,
generation config), and each format's reference dequantization (what a loader computes;
independent of the quantizer, for loader tests).

* GPTQ, AutoGPTQ / GPTQModel ``checkpoint_format: gptq`` (v1): ``qweight`` int32
  (K / (32/bits), N) packed along the input dim, sequential order; ``qzeros`` int32
  (G, N / (32/bits)) packed along dim 1 holding zero - 1; ``scales`` float16 (G, N);
  ``g_idx`` int32 (K,). w[k, n] = scales[g, n] * (q[k, n] - (qzeros[g, n] + 1)), g = g_idx[k].
* AWQ GEMM (AutoAWQ): ``qweight`` int32 (K, N / 8) and ``qzeros`` int32 (G, N / 8) packed
  along dim 1 in ``AWQ_ORDER``; ``scales`` float16 (G, N); w = (q - z) * s, g = k // group.
* compressed-tensors (llm-compressor) ``int-quantized``: ``weight`` int8 (N, K),
  ``weight_scale`` (N, 1); ``float-quantized``: ``weight`` float8_e4m3fn (N, K),
  ``weight_scale`` (N, 1) per channel or (1,) per tensor. w = weight * weight_scale; scales
  in the checkpoint's dtype, as llm-compressor writes them; no zero point (symmetric).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from heron.quant.packing import AWQ_ORDER, pack_int32, unpack_int32
from heron.quantizer.intgrid import IntQuant, ScaledQuant

IGNORE = ["lm_head"]  # never quantized: the LM head (and the embeddings, not a Linear)


# -- tensors -------------------------------------------------------------------------------

def gptq_tensors(r: IntQuant) -> dict[str, torch.Tensor]:
    if int(r.zeros.min()) < 1:
        raise ValueError("GPTQ v1 stores zero - 1: zero points must be >= 1")
    return {
        "qweight": pack_int32(r.q.t(), r.bits, dim=0),
        "qzeros": pack_int32(r.zeros - 1, r.bits, dim=1),
        "scales": r.scales.to(torch.float16),
        "g_idx": r.g_idx.to(torch.int32),
    }


def awq_tensors(r: IntQuant) -> dict[str, torch.Tensor]:
    k = r.q.shape[1]
    if r.bits != 4 or r.group_size <= 0 or k % r.group_size:
        raise ValueError("AWQ GEMM stores 4-bit weights in whole groups of input channels")
    if not torch.equal(r.g_idx, torch.arange(k) // r.group_size):
        raise ValueError("AWQ GEMM has no g_idx: groups must be sequential")
    return {
        "qweight": pack_int32(r.q.t(), 4, dim=1, order=AWQ_ORDER),
        "qzeros": pack_int32(r.zeros, 4, dim=1, order=AWQ_ORDER),
        "scales": r.scales.to(torch.float16),
    }


def compressed_tensors_tensors(r: ScaledQuant) -> dict[str, torch.Tensor]:
    return {"weight": r.q, "weight_scale": r.scale.to(r.scale_dtype)}


# -- reference dequantization ----------------------------------------------------------------

def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, bits: int) -> torch.Tensor:
    """GPTQ v1 tensors -> float32 (N, K). ``g_idx`` None: sequential groups of K // G."""
    n = scales.shape[1]
    q = unpack_int32(qweight, bits, dim=0).to(torch.float32)  # (K, N)
    z = unpack_int32(qzeros, bits, dim=1, size=n).to(torch.float32) + 1  # (G, N)
    k = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(k) // (k // scales.shape[0])
    g = g_idx.to(torch.long)
    return (scales.to(torch.float32)[g] * (q - z[g])).t().contiguous()


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor,
                   scales: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM tensors -> float32 (N, K) (group size K // G)."""
    n = scales.shape[1]
    q = unpack_int32(qweight, 4, dim=1, size=n, order=AWQ_ORDER).to(torch.float32)  # (K, N)
    z = unpack_int32(qzeros, 4, dim=1, size=n, order=AWQ_ORDER).to(torch.float32)
    k = q.shape[0]
    g = torch.arange(k) // (k // scales.shape[0])
    return ((q - z[g]) * scales.to(torch.float32)[g]).t().contiguous()


def compressed_tensors_dequantize(weight: torch.Tensor,
                                  weight_scale: torch.Tensor) -> torch.Tensor:
    """int8 / float8_e4m3fn (N, K) times (N, 1) or (1,) scales -> float32 (N, K)."""
    return weight.to(torch.float32) * weight_scale.to(torch.float32)


# -- quantization_config --------------------------------------------------------------------

def gptq_config(bits: int, group_size: int, desc_act: bool, sym: bool,
                damp_percent: float) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
            "desc_act": desc_act, "sym": sym, "damp_percent": damp_percent,
            "true_sequential": True, "static_groups": False, "lm_head": False,
            "checkpoint_format": "gptq", "model_name_or_path": None,
            "model_file_base_name": None}


def awq_config(group_size: int = 128) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def _ct_args(num_bits: int, type_: str, strategy: str, dynamic: bool,
             observer: str | None) -> dict:
    """compressed-tensors QuantizationArgs, the fields every release since 0.7 accepts
    (its pydantic model forbids unknown keys; scale_dtype / zp_dtype are left to default)."""
    return {"num_bits": num_bits, "type": type_, "symmetric": True, "group_size": None,
            "strategy": strategy, "block_structure": None, "dynamic": dynamic,
            "actorder": None, "observer": observer, "observer_kwargs": {}}


def compressed_tensors_config(kind: str, weight_strategy: str = "channel") -> dict:
    """``kind``: ``int8`` (W8A8 int, SmoothQuant) or ``fp8`` (FP8 dynamic)."""
    type_, fmt = {"int8": ("int", "int-quantized"), "fp8": ("float", "float-quantized")}[kind]
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": _ct_args(8, type_, weight_strategy, False, "minmax"),
            "input_activations": _ct_args(8, type_, "token", True, None),
            "output_activations": None,
        }},
        "ignore": list(IGNORE),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


# -- the directory --------------------------------------------------------------------------

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def checkpoint_state_dict(model, layer_tensors: dict[str, dict[str, torch.Tensor]],
                          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors with each quantized linear's ``weight`` replaced by its format
    tensors (``layer_tensors``: module name -> tensors); other floats cast to ``dtype``; a
    tied LM head left out, as ``save_pretrained`` does."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out = {}
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in layer_tensors and leaf == "weight":
            continue
        if tied and name == "lm_head.weight":
            continue
        t = t.detach()
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    for module, tensors in layer_tensors.items():
        for leaf, t in tensors.items():
            out[f"{module}.{leaf}"] = t.contiguous()
    return out


def write_checkpoint(out_dir: str | Path, model, tokenizer,
                     layer_tensors: dict[str, dict[str, torch.Tensor]],
                     quantization_config: dict, dtype: torch.dtype = torch.float32,
                     side_files: dict[str, dict] | None = None) -> Path:
    """A loadable HF directory: model.safetensors, config.json with ``quantization_config``
    (and ``dtype``), generation_config.json, the tokenizer, and ``side_files`` (name -> JSON,
    e.g. AutoGPTQ's quantize_config.json)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = checkpoint_state_dict(model, layer_tensors, dtype)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # e.g. "gguf" for a GGUF-loaded source
    config.pop("torch_dtype", None)
    config["dtype"] = DTYPE_NAMES[dtype]
    config["architectures"] = [type(model).__name__]
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    for name, content in (side_files or {}).items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    return out
