"""Quantized checkpoints written the way their reference tools publish them, from a tiny HF
model, plus the float model each one stands for (the oracle heron is checked against).

The writers here are independent of heron's loaders and of ``heron quantize``: plain
round-to-nearest, packed with the formats' documented layouts. ``reference_model`` swaps each
projection's weight for the dequantized one and, for W8A8 / FP8 schemes, rounds each linear's
input per token the way the scheme does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from heron.quant.packing import AWQ_ORDER, pack_int32

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _asym_groups(w: torch.Tensor, bits: int, members: torch.Tensor):
    """w (N, K); members (G, gs) input indices per group -> q (N, K), scale, zero (N, G)."""
    qmax = (1 << bits) - 1
    q = torch.empty(w.shape, dtype=torch.int64)
    scales, zeros = [], []
    for idx in members:
        part = w[:, idx]
        lo, hi = part.min(1).values.clamp(max=0), part.max(1).values.clamp(min=0)
        scale = ((hi - lo) / qmax).clamp(min=1e-8).half().float()
        zero = (-lo / scale).round().clamp(1, qmax)
        q[:, idx] = (part / scale[:, None] + zero[:, None]).round().clamp(0, qmax).long()
        scales.append(scale)
        zeros.append(zero)
    return q, torch.stack(scales, 1), torch.stack(zeros, 1)


def _gptq(w, bits, group, act_order, gen):
    """Act-order: one permutation per input width, as GPTQ gets from the shared input's
    Hessian for projections fused in heron (q/k/v, gate/up)."""
    n, k = w.shape
    order = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if act_order \
        else torch.arange(k)
    members = list(order.split(group))  # the last group is shorter when group ∤ K
    q, scale, zero = _asym_groups(w, bits, members)
    g_idx = torch.empty(k, dtype=torch.int32)
    for g, idx in enumerate(members):
        g_idx[idx] = g
    deq = (q - zero[:, g_idx.long()]) * scale[:, g_idx.long()]
    tensors = {"qweight": pack_int32(q.t(), bits, dim=0),
               "qzeros": pack_int32((zero - 1).long().t(), bits, dim=1),  # v1: zero - 1
               "scales": scale.t().half().contiguous(), "g_idx": g_idx}
    return tensors, deq


def _awq(w, group):
    n, k = w.shape
    q, scale, zero = _asym_groups(w, 4, torch.arange(k).reshape(-1, group))
    g = torch.arange(k) // group
    deq = (q - zero[:, g]) * scale[:, g]
    return {"qweight": pack_int32(q.t(), 4, dim=1, order=AWQ_ORDER),
            "qzeros": pack_int32(zero.long().t(), 4, dim=1, order=AWQ_ORDER),
            "scales": scale.t().half().contiguous()}, deq


def _ct_w4a16(w, group):
    n, k = w.shape
    grouped = w.reshape(n, k // group, group)
    scale = (grouped.abs().amax(-1) / 7.5).clamp(min=1e-8)  # (N, G)
    v = (grouped / scale[..., None]).round().clamp(-8, 7).reshape(n, k)
    deq = (v.reshape(n, -1, group) * scale[..., None]).reshape(n, k)
    return {"weight_packed": pack_int32((v + 8).long(), 4, dim=1), "weight_scale": scale,
            "weight_shape": torch.tensor([n, k])}, deq


def _ct_int8(w):
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
    v = (w / scale).round().clamp(-128, 127)
    return {"weight": v.to(torch.int8), "weight_scale": scale}, v * scale


def _ct_fp8(w, per_tensor: bool):
    amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
    scale = (amax / 448).clamp(min=1e-8).reshape(1) if per_tensor else (amax / 448)
    f8 = (w / scale).to(torch.float8_e4m3fn)
    tensors = {"weight": f8, "weight_scale": scale}
    return tensors, f8.float() * scale


def _ct_config(fmt: str, weights: dict, activations: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}


SCHEMES = {
    # name: (writer(w, gen), quantization_config, activation rounding or None)
    "gptq-4bit-g32": (lambda w, g: _gptq(w, 4, 32, False, g),
                      {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                       "sym": False, "checkpoint_format": "gptq"}, None),
    "gptq-4bit-g48-partial": (lambda w, g: _gptq(w, 4, 48, False, g),
                              {"quant_method": "gptq", "bits": 4, "group_size": 48,
                               "desc_act": False, "sym": False}, None),
    "gptq-8bit-g64": (lambda w, g: _gptq(w, 8, 64, False, g),
                      {"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": False,
                       "sym": False}, None),
    "gptq-4bit-act-order": (lambda w, g: _gptq(w, 4, 32, True, g),
                            {"quant_method": "gptq", "bits": 4, "group_size": 32,
                             "desc_act": True, "sym": False}, None),
    "awq-gemm-g32": (lambda w, g: _awq(w, 32),
                     {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                      "version": "gemm"}, None),
    "ct-w4a16": (lambda w, g: _ct_w4a16(w, 32), _ct_config(
        "pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                           "strategy": "group", "group_size": 32}, None), None),
    "ct-w8a8-int8": (lambda w, g: _ct_int8(w), _ct_config(
        "int-quantized", {"num_bits": 8, "type": "int", "symmetric": True,
                          "strategy": "channel"},
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
         "dynamic": True}), "int8"),
    "ct-fp8-dynamic": (lambda w, g: _ct_fp8(w, False), _ct_config(
        "float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
                            "strategy": "channel"},
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
         "dynamic": True}), "fp8"),
    "ct-fp8-static": (lambda w, g: _ct_fp8(w, True), _ct_config(
        "float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
                            "strategy": "tensor"},
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
         "dynamic": False}), "fp8-static"),
}


# per projection, as calibration would store them; distinct within each fused group
STATIC_INPUT_SCALES = {p: 0.03 + 0.01 * i for i, p in enumerate(PROJ)}
_FUSED = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})


def fused_input_scale(proj: str) -> float:
    """A fused layer runs one input scale: the largest of its projections' (vLLM's rule)."""
    group = next((g for g in _FUSED if proj in g), {proj})
    return max(STATIC_INPUT_SCALES[p] for p in group)


def write_quantized(src: Path, dst: Path, scheme: str) -> dict[str, torch.Tensor]:
    """Quantize every projection of the HF dir ``src`` into ``dst``; returns the dequantized
    weights by tensor name."""
    writer, qc, act = SCHEMES[scheme]
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    out, dequantized = {}, {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in PROJ:
            parts, deq = writer(t.float(), gen)
            out.update({f"{module}.{k}": v for k, v in parts.items()})
            dequantized[name] = deq.float()
            if act == "fp8-static":  # a per-tensor input scale, as calibration would store
                proj = module.rsplit(".", 1)[-1]
                out[f"{module}.input_scale"] = torch.tensor([STATIC_INPUT_SCALES[proj]])
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized


def reference_model(hf_model, dequantized: dict[str, torch.Tensor], scheme: str):
    """The HF model with the dequantized weights and the scheme's activation rounding."""
    act = SCHEMES[scheme][2]
    state = hf_model.state_dict()
    state.update(dequantized)
    model = type(hf_model)(hf_model.config).float().eval()
    model.load_state_dict(state)
    if act is None:
        return model
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJ:
            scale = fused_input_scale(name.rsplit(".", 1)[-1])
            module.register_forward_pre_hook(_rounding_hook(act, scale))
    return model


def _rounding_hook(kind: str, static_scale: float | None):
    def hook(_, args):
        x = args[0]
        if kind == "int8":
            s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
            return ((x / s).round().clamp(-128, 127) * s,)
        s = torch.tensor(static_scale) if kind == "fp8-static" else \
            (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,)
    return hook
