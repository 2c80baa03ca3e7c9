#!/usr/bin/env python3
"""Check our understanding of each on-disk format against the reference tools.

For every checkpoint written by ``make_checkpoints.py``, dequantize
``model.layers.0.{self_attn.q_proj,mlp.down_proj}`` from the raw safetensors with the small,
self-contained decoders below (written from the format descriptions, no tool code), and compare
``x @ W.T`` with the output of the HF-transformers-loaded module (which runs through
compressed-tensors / gptqmodel's torch kernels).  Expected: 0 for compressed-tensors; ~1e-3 for
GPTQ/AWQ (the torch kernels round the dequantized weight to the fp16 scale dtype).  Prints one JSON line per checkpoint.  Run in the peer venv::

    .venv/peers/quant/bin/python benchmarks/quant_reference/verify_formats.py --out /tmp/quant_ref
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

torch.set_num_threads(1)

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble j of a word holds logical column AWQ_ORDER[j]


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> [R*32/bits, C]; element k of a word = bits [k*bits, (k+1)*bits)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    v = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return v.reshape(packed.shape[0] * per, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_rows(packed.t().contiguous(), bits).t()


def dequant_ct(t: dict, qc: dict) -> torch.Tensor:
    w_args = qc["config_groups"]["group_0"]["weights"]
    fmt = qc["format"]
    scale = t["weight_scale"].float()
    if fmt in ("int-quantized", "float-quantized"):
        q = t["weight"].float()  # int8 or float8_e4m3fn, [out, in]
    elif fmt == "pack-quantized":
        bits = w_args["num_bits"]
        out_f, in_f = t["weight_shape"].tolist()
        q = unpack_cols(t["weight_packed"], bits)[:, :in_f].float() - (1 << (bits - 1))
        assert q.shape == (out_f, in_f)
    else:
        raise NotImplementedError(fmt)
    zp = None
    if "weight_zero_point" in t:
        bits = w_args["num_bits"]
        zp = unpack_rows(t["weight_zero_point"], bits)[: scale.shape[0]].float() - (1 << (bits - 1))
    out_f, in_f = q.shape
    if scale.numel() == 1:
        s = scale.reshape(1, 1).expand(out_f, in_f)
        z = 0.0
    else:
        reps = in_f // scale.shape[1]  # (out,1): per-channel; (out,G): group size in/G
        s = scale.repeat_interleave(reps, dim=1)
        z = 0.0 if zp is None else zp.repeat_interleave(reps, dim=1)
    return (q - z) * s


def dequant_gptq(t: dict, bits: int) -> torch.Tensor:
    q = unpack_rows(t["qweight"], bits).float()  # [in, out]
    z = unpack_cols(t["qzeros"], bits).float() + 1  # GPTQ v1: stored zero = z - 1
    s = t["scales"].float()  # [G, out]
    g = t["g_idx"].long()  # [in]
    return ((q - z[g]) * s[g]).t()  # [out, in]


def dequant_awq(t: dict, bits: int) -> torch.Tensor:
    order = torch.tensor(AWQ_ORDER)
    inv = torch.argsort(order)

    def unpack(p):  # [R, C/8] -> [R, C], undoing the interleave
        per = 32 // bits
        shifts = torch.arange(per, dtype=torch.int32) * bits
        v = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C/8, 8] physical nibbles
        v = v[..., inv]  # logical column c*8+k lives in nibble AWQ_ORDER.index(k)
        return v.reshape(p.shape[0], -1)

    q = unpack(t["qweight"]).float()  # [in, out]
    z = unpack(t["qzeros"]).float()  # [G, out], no offset
    s = t["scales"].float()
    gs = q.shape[0] // s.shape[0]
    return ((q - z.repeat_interleave(gs, 0)) * s.repeat_interleave(gs, 0)).t()


def main() -> None:
    import sys

    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_checkpoints import load_hf

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    for d in sorted(p for p in a.out.iterdir() if (p / "config.json").exists()):
        qc = json.loads((d / "config.json").read_text()).get("quantization_config")
        if qc is None:
            continue
        sd = {}
        for f in d.glob("*.safetensors"):
            sd.update(load_file(f))
        model = load_hf(d)  # gptqmodel torch kernels for GPTQ/AWQ (fp16 scales, fp32 matmul)
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long))  # triggers CT decompression
        res = {"ckpt": d.name}
        for mod_name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
            t = {k[len(mod_name) + 1:]: v for k, v in sd.items() if k.startswith(mod_name + ".")}
            qm = qc.get("quant_method")
            if qm == "compressed-tensors":
                w = dequant_ct(t, qc)
            elif qm == "gptq":
                w = dequant_gptq(t, qc["bits"])
            elif qm == "awq":
                w = dequant_awq(t, qc["bits"])
            else:
                raise NotImplementedError(qm)
            m = model.get_submodule(mod_name)
            torch.manual_seed(0)
            x = torch.randn(1, 4, w.shape[1])
            with torch.no_grad():
                if hasattr(m, "quantization_enabled") or hasattr(m, "quantization_scheme"):
                    m.quantization_enabled = False  # weight-only comparison (no activation QDQ)
                y_ref = m(x).float()
            y = x @ w.t()
            res[mod_name.split(".")[-1]] = {
                "max_abs_err": float((y - y_ref).abs().max()),
                "ref_max": float(y_ref.abs().max()),
            }
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
