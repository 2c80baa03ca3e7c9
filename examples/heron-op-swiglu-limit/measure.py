"""The accuracy effect of ``swiglu_limit`` on a real model, measured before trusting the kernel:
perplexity of SmolLM2-135M-Instruct (heron's embedded GGUF) on held-out text (the Shakespeare
play ``heron quantize`` never calibrates on, as benchmarks/quantization.py), with the built-in
activation and with the plugin selected, and how often the clamp bites (gate > 7 or |up| > 7).

    .venv/bin/python examples/heron-op-swiglu-limit/measure.py [--chunks 8 --chunk-len 256]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from heron.attention import AttentionMetadata, ForwardContext, forward_context
from heron.attention import get_attention_backend
from heron.layers.dispatch import apply_custom_ops
from heron.layers.rotary import RotaryEmbedding
from heron.loader.model_source import resolve_model
from heron.loader.weights import build_model, materialize_weights, optimize_layout
from heron.models import ModelArchConfig
from heron.loader.gguf_loader import find_default_gguf
from heron.quant.config import resolve_quantization

CPU, LIMIT = torch.device("cpu"), 7.0


def load():
    """(model, tokenizer) of the embedded SmolLM2 GGUF, as the worker builds it on CPU."""
    from transformers import AutoTokenizer

    source = resolve_model(None)
    arch = ModelArchConfig.from_hf(source.hf_config)
    quant = resolve_quantization(source.quantization, source.is_gguf, None, "cpu")
    model = build_model(arch, torch.float32, CPU, quant)
    materialize_weights(model, source, "auto", torch.float32, 0, quant)
    optimize_layout(model, CPU)
    path = find_default_gguf()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


def logits(model, ids: list[int]) -> torch.Tensor:
    """One prefill of ``ids`` with the torch attention backend -> (T, vocab) float32."""
    cfg, n, bs = model.config, len(ids), 16
    blocks = -(-n // bs)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reserve(n, CPU)
    kv = [torch.zeros(2, blocks, bs, cfg.num_kv_heads, cfg.head_dim)
          for _ in range(cfg.num_layers)]
    md = AttentionMetadata(torch.arange(n), torch.arange(blocks)[None], torch.tensor([n]),
                           torch.tensor([0, n]), [0, n], [n], [n], bs)
    with torch.inference_mode(), forward_context(
            ForwardContext(md, kv, get_attention_backend("torch", CPU))):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n)))


def perplexity(model, chunks: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for ids in chunks:
        logp = torch.log_softmax(logits(model, ids).double(), dim=-1)
        nll -= logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum().item()
        count += len(ids) - 1
    return math.exp(nll / count)


def count_bites(model) -> dict:
    """Hooks on each MLP's gate_up projection counting where the clamp changes an input."""
    stats = dict(elements=0, gate=0, up=0, tokens=0, tokens_bitten=0, max_gate=0.0, max_up=0.0)

    def hook(module, args, out):
        gate, up = out.chunk(2, dim=-1)
        bite = (gate > LIMIT) | (up.abs() > LIMIT)
        stats["elements"] += gate.numel()
        stats["gate"] += int((gate > LIMIT).sum())
        stats["up"] += int((up.abs() > LIMIT).sum())
        stats["tokens"] += gate.shape[0]
        stats["tokens_bitten"] += int(bite.any(dim=-1).sum())
        stats["max_gate"] = max(stats["max_gate"], float(gate.max()))
        stats["max_up"] = max(stats["max_up"], float(up.abs().max()))

    handles = [m.gate_up_proj.register_forward_hook(hook) for m in model.modules()
               if hasattr(m, "gate_up_proj")]
    return stats, handles


def main() -> None:
    from heron.quantizer.calibration import held_out_text

    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-len", type=int, default=256)
    args = p.parse_args()
    model, tok = load()
    ids = tok(held_out_text(), add_special_tokens=False)["input_ids"]
    stride = (len(ids) - args.chunk_len) // max(1, args.chunks - 1)
    chunks = [ids[i:i + args.chunk_len] for i in range(0, stride * args.chunks, stride)]
    chunks = [c for c in chunks if len(c) == args.chunk_len][:args.chunks]
    stats, handles = count_bites(model)
    base = perplexity(model, chunks)
    for h in handles:
        h.remove()
    apply_custom_ops(model, "swiglu_limit", CPU, torch.float32)
    clamped = perplexity(model, chunks)
    record = dict(model="SmolLM2-135M-Instruct (embedded GGUF)", chunks=len(chunks),
                  chunk_len=args.chunk_len, ppl_builtin=base, ppl_swiglu_limit=clamped,
                  ppl_delta_pct=100 * (clamped / base - 1), **stats)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
