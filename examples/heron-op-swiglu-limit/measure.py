"""The accuracy effect of ``swiglu_limit`` on a real model, measured before trusting the kernel:
perplexity of SmolLM2-135M-Instruct (heron's embedded GGUF) on held-out text (the Shakespeare
play ``heron quantize`` never calibrates on, as benchmarks/quantization.py), through heron's
engine with the built-in activation and with ``--custom-ops swiglu_limit``, and how often the
clamp bites (gate > 7 or |up| > 7).

    .venv/bin/python examples/heron-op-swiglu-limit/measure.py [--chunks 8 --chunk-len 256]
"""

from __future__ import annotations

import argparse
import json
import math

from heron import LLM, SamplingParams

LIMIT = 7.0


def count_bites(model) -> tuple[dict, list]:
    """Hooks on each MLP's gate_up projection counting where the clamp changes an input."""
    stats = dict(elements=0, gate=0, up=0, tokens=0, tokens_bitten=0, max_gate=0.0, max_up=0.0)

    def hook(module, args, out):
        gate, up = out.chunk(2, dim=-1)
        stats["elements"] += gate.numel()
        stats["gate"] += int((gate > LIMIT).sum())
        stats["up"] += int((up.abs() > LIMIT).sum())
        stats["tokens"] += gate.shape[0]
        stats["tokens_bitten"] += int(((gate > LIMIT) | (up.abs() > LIMIT)).any(dim=-1).sum())
        stats["max_gate"] = max(stats["max_gate"], float(gate.max()))
        stats["max_up"] = max(stats["max_up"], float(up.abs().max()))

    handles = [m.gate_up_proj.register_forward_hook(hook) for m in model.modules()
               if hasattr(m, "gate_up_proj")]
    return stats, handles


def perplexity(llm: LLM, chunks: list[list[int]]) -> float:
    """exp(mean NLL) of each chunk's tokens after its first, from the prompt logprobs."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params)
    nll = -sum(out.prompt_logprobs[pos][chunk[pos]][0]
               for chunk, out in zip(chunks, outs) for pos in range(1, len(chunk)))
    return math.exp(nll / sum(len(c) - 1 for c in chunks))


def held_out_chunks(llm: LLM, num: int, length: int) -> list[list[int]]:
    from heron.quantizer.calibration import held_out_text

    ids = llm.get_tokenizer()(held_out_text(), add_special_tokens=False)["input_ids"]
    stride = (len(ids) - length) // max(1, num - 1)
    chunks = [ids[i:i + length] for i in range(0, stride * num, stride)]
    return [c for c in chunks if len(c) == length][:num]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-len", type=int, default=256)
    args = p.parse_args()
    # no prefix caching: the second engine must compute every chunk with its own activation
    builtin = LLM(enable_prefix_caching=False)
    chunks = held_out_chunks(builtin, args.chunks, args.chunk_len)
    stats, handles = count_bites(builtin.engine.core.executor.worker.runner.model)
    base = perplexity(builtin, chunks)
    for h in handles:
        h.remove()
    del builtin
    clamped = perplexity(LLM(enable_prefix_caching=False, custom_ops="swiglu_limit"), chunks)
    record = dict(model="SmolLM2-135M-Instruct (embedded GGUF)", chunks=len(chunks),
                  chunk_len=args.chunk_len, ppl_builtin=base, ppl_swiglu_limit=clamped,
                  ppl_delta_pct=100 * (clamped / base - 1), **stats)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
