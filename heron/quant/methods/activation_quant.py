"""8-bit methods: int8 weights with int8 activations (W8A8, SmoothQuant's output) and FP8.

Weights keep their checkpoint dtype (int8, float8_e4m3fn) with one scale per output row
(per-channel checkpoints) or per fused projection (per-tensor checkpoints: each shard's scale
is broadcast over its rows). Activations are quantized per token at run time (``dynamic``:
scale = max |x| of the row / qmax) or with the checkpoint's ``input_scale`` (``static``: the
largest over the fused shards), then multiplied against the 8-bit weight.

On CPU the int8 matmul goes through the grouped-integer kernel (one group per row, exact
int8 values; fp32 accumulation) since torch's ``_int_mm`` has no fast CPU path; on CUDA
through ``torch._int_mm`` (int32 accumulation). FP8 with quantized activations runs
``torch._scaled_mm`` (row-wise scales: per token for x, per output row for the weight) where
the GPU has fp8 tensor cores (compute capability 8.9+: Ada, Hopper); elsewhere it is
emulated: activations rounded through float8_e4m3fn, the weight decoded exactly from its fp8
bytes (on CPU by heron's kernel, ``torch.ops.heron_cpu.fp8_linear``; else a tile at a time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.kernels import cpu as cpu_kernels
from heron.kernels.fp8_gemm import scaled_mm_is_fast, scaled_mm_rowwise
from heron.quant.base import FULL, LinearMethod, ParamLayout, add_param
from heron.quant.int_layout import GroupedIntWeight, quant_linear

INT8_MAX = 127.0
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
_TILE_FLOATS = 1 << 22  # weight elements dequantized at once by the FP8 emulation


def int_mm_is_fast(weight: torch.Tensor) -> bool:
    """torch._int_mm has a fast kernel on CUDA only (on CPU it is a naive loop)."""
    return weight.is_cuda


def _scale_params(layer, strategy: str, with_zero_point: bool) -> None:
    """weight_scale (and weight_zero_point): (N, 1) per channel, one per shard per tensor."""
    if strategy == "channel":
        shape, layout = (layer.out_features, 1), ParamLayout(output_dim=0, input_dim=None)
    elif strategy == "tensor":
        shape, layout = (len(layer.output_sizes), 1), ParamLayout(per_shard=True)
    else:
        raise ValueError(f"weight strategy {strategy!r} is not supported (channel, tensor)")
    add_param(layer, "weight_scale", shape, torch.float32, layout)
    if with_zero_point:
        add_param(layer, "weight_zero_point", shape, torch.int8, layout, optional=True)


def _row_values(layer, param: torch.Tensor, strategy: str) -> torch.Tensor:
    """A per-channel (N, 1) or per-shard (shards, 1) parameter -> one value per row (N,)."""
    if strategy == "channel":
        return param.reshape(-1).to(torch.float32)
    sizes = torch.tensor(layer.output_sizes)
    return param.reshape(-1).to(torch.float32).repeat_interleave(sizes)


def _input_scale_param(layer, activations: str | None) -> None:
    if activations == "static":
        add_param(layer, "input_scale", (len(layer.output_sizes), 1), torch.float32,
                  ParamLayout(per_shard=True))


def _static_input_scale(layer) -> torch.Tensor | None:
    if "input_scale" not in layer.param_layouts:
        return None
    return layer.input_scale.data.max().to(torch.float32)


def quantize_activations(x: torch.Tensor, qmax: float, static_scale: torch.Tensor | None,
                         fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) -> (quantized values as float or fp8, scale (..., 1) or scalar)."""
    x = x.to(torch.float32)
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-12)
    else:
        scale = static_scale
    if fp8:
        return (x / scale).clamp(-qmax, qmax).to(torch.float8_e4m3fn), scale
    return (x / scale).round().clamp(-qmax - 1, qmax), scale


class W8A8Int8Method(LinearMethod):
    """int8 weights (N, K); activations int8 per token or static, or float (W8A16)."""

    name = "int8"

    def __init__(self, strategy: str, activations: str | None) -> None:
        self.strategy, self.activations = strategy, activations
        self.name = "w8a8 int8" if activations else "w8a16 int8"

    def create_weights(self, layer, dtype) -> None:
        add_param(layer, "weight", (layer.out_features, layer.in_features), torch.int8, FULL)
        _scale_params(layer, self.strategy, with_zero_point=True)
        _input_scale_param(layer, self.activations)

    def process_weights_after_loading(self, layer) -> None:
        scale = _row_values(layer, layer.weight_scale.data, self.strategy)  # (N,)
        zero = torch.zeros_like(scale)
        if "weight_zero_point" in layer.loaded_params:
            zero = _row_values(layer, layer.weight_zero_point.data, self.strategy)
        w = layer.weight.data
        layer.static_input_scale = _static_input_scale(layer)
        layer.use_int_mm = int_mm_is_fast(w) and not bool(zero.any())
        if layer.use_int_mm:
            layer.weight_t, layer.row_scale = w.t(), scale  # (K, N) for _int_mm
            layer.grouped = None
        else:
            q = (w.to(torch.int16) + 128).to(torch.uint8)  # exact: w = (q - 128 - z) * s
            layer.grouped = GroupedIntWeight.from_values(
                q, scale[:, None], (-(128.0 + zero) * scale)[:, None], w.shape[1], 8)
            del layer.weight
            del layer.param_layouts["weight"]

    def apply(self, layer, x, bias=None):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.activations:
            xq, sx = quantize_activations(x2, INT8_MAX, layer.static_input_scale, fp8=False)
        if layer.use_int_mm:
            xi = xq.to(torch.int8) if self.activations else None
            if xi is None:
                raise ValueError("int8 weights without activation quantization run on the "
                                 "grouped kernel, not _int_mm")
            y = torch._int_mm(xi, layer.weight_t).to(torch.float32) * sx * layer.row_scale
        else:
            y = quant_linear(xq * sx if self.activations else x2, layer.grouped)
        y = y.to(x.dtype).reshape(*lead, -1)
        return y if bias is None else y + bias

    def weight_bytes(self, layer) -> int:
        if layer.grouped is not None:
            return layer.grouped.nbytes
        return layer.weight_t.numel() + layer.row_scale.numel() * 4


class FP8LinearMethod(LinearMethod):
    """float8_e4m3fn weights with per-channel or per-tensor scales; ``quantize_on_load``:
    the checkpoint is float and each weight is quantized per channel as it loads (vLLM's
    ``--quantization fp8`` on an unquantized model)."""

    name = "fp8"

    def __init__(self, strategy: str, activations: str | None,
                 quantize_on_load: bool = False) -> None:
        self.strategy, self.activations = strategy, activations
        self.quantize_on_load = quantize_on_load
        self.name = "fp8 w8a8" if activations else "fp8 w8a16"

    def create_weights(self, layer, dtype) -> None:
        if self.quantize_on_load:
            add_param(layer, "weight", (layer.out_features, layer.in_features), dtype, FULL)
            return
        add_param(layer, "weight", (layer.out_features, layer.in_features),
                  torch.float8_e4m3fn, FULL)
        _scale_params(layer, self.strategy, with_zero_point=False)
        _input_scale_param(layer, self.activations)

    def process_weights_after_loading(self, layer) -> None:
        if self.quantize_on_load:
            w = layer.weight.data.to(torch.float32)
            scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)  # (N,)
            layer.weight.data = (w / scale[:, None]).to(torch.float8_e4m3fn)
        else:
            scale = _row_values(layer, layer.weight_scale.data, self.strategy)
        layer.row_scale = scale
        layer.static_input_scale = None if self.quantize_on_load else _static_input_scale(layer)
        n, k = layer.weight.shape
        layer.use_scaled_mm = (self.activations is not None and n % 16 == 0 and k % 16 == 0
                               and scaled_mm_is_fast(layer.weight.data))

    def apply(self, layer, x, bias=None):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        if self.activations:
            xq, sx = quantize_activations(x2, FP8_MAX, layer.static_input_scale, fp8=True)
            if layer.use_scaled_mm:
                y = scaled_mm_rowwise(xq, sx, layer.weight.data.t(), layer.row_scale)
                y = y.to(x.dtype).reshape(*lead, -1)
                return y if bias is None else y + bias
            x2 = xq.to(torch.float32) * sx
        w, scale = layer.weight.data, layer.row_scale
        if w.is_cpu and cpu_kernels.load():  # fp8 decoded in the kernel, 8 values at a time
            y = torch.ops.heron_cpu.fp8_linear(x2.contiguous(), w, scale)
            y = y.to(x.dtype).reshape(*lead, -1)
            return y if bias is None else y + bias
        y = x2.new_empty(x2.shape[0], w.shape[0])
        tile = max(1, _TILE_FLOATS // w.shape[1])
        for n0 in range(0, w.shape[0], tile):
            rows = slice(n0, n0 + tile)
            y[:, rows] = F.linear(x2, w[rows].to(torch.float32) * scale[rows, None])
        y = y.to(x.dtype).reshape(*lead, -1)
        return y if bias is None else y + bias

    def weight_bytes(self, layer) -> int:
        return layer.weight.numel() + layer.row_scale.numel() * 4
