"""Quantization, side by side in one run: perplexity of SmolLM2-135M-Instruct on held-out
text (a Shakespeare play that ``heron quantize`` never calibrates on) for every weight format
(and for the GGUF with ``--cpu-int8-dot``: 8-bit activations, integer dot products), and
batch-1 / batch-64 decode speed of heron 4-bit vs heron float32 vs llama.cpp on the same
GGUF file.

The float32 baseline is the shipped Q4_1 GGUF dequantized (SmolLM2 is only available here as
that file), so "Q4_1 kept quantized" holds the baseline's very values (its delta is ~0 by
construction), and GPTQ / AWQ / SmoothQuant / FP8 re-quantize those float32 weights.

    python benchmarks/quantization.py [--threads 1] [--skip-quantize] [--llama-python PY]

llama.cpp runs through llama-cpp-python in its own venv (``--llama-python``; skipped when
absent). Prints a table and one JSON line; writes benchmarks/results/quantization.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DECODE_TOKENS = 128
DECODE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def held_out_chunks(tokenizer, num_chunks: int, chunk_len: int) -> list[list[int]]:
    from heron.quantizer.calibration import held_out_text

    ids = tokenizer(held_out_text(), add_special_tokens=False)["input_ids"]
    stride = max(chunk_len, (len(ids) - chunk_len) // max(1, num_chunks - 1))
    return [ids[i:i + chunk_len] for i in range(0, stride * num_chunks, stride)
            if len(ids[i:i + chunk_len]) == chunk_len][:num_chunks]


def perplexity(llm, chunks: list[list[int]]) -> float:
    from heron import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params)
    nll, count = 0.0, 0
    for chunk, out in zip(chunks, outs):
        for pos in range(1, len(chunk)):
            nll -= out.prompt_logprobs[pos][chunk[pos]][0]
            count += 1
    return math.exp(nll / count)


def decode_speed(llm, batch: int) -> float:
    """Output tokens per second, decode only: the batch's time minus a 1-token run's."""
    from heron import SamplingParams

    prompts = [DECODE_PROMPT + f" ({i})" for i in range(batch)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], one)  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, one)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, full)
    total = time.perf_counter() - t0
    return batch * (DECODE_TOKENS - 1) / max(1e-9, total - prefill)


def quantize_variants(work: Path, threads: int) -> dict[str, Path]:
    """heron quantize's outputs from the shipped GGUF (calibrated on shakespeare)."""
    runs = {
        "fp8 (heron quantize)": ["--method", "fp8"],
        "w8a8 int8 smoothquant": ["--method", "smoothquant"],
        "gptq w4a16 g128": ["--method", "gptq", "--bits", "4", "--group-size", "128"],
        "awq w4a16 g64": ["--method", "awq", "--group-size", "64"],
    }
    out = {}
    for label, args in runs.items():
        path = work / label.split()[0]
        if not (path / "config.json").is_file():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "heron", "quantize", *args, "--out",
                            str(path), "--calib", "shakespeare", "--num-samples", "32",
                            "--seq-len", "256", "--threads", str(threads)], check=True)
            print(f"quantized {label} in {time.perf_counter() - t0:.0f} s", flush=True)
        out[label] = path
    return out


LLAMA_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
path, threads, tokens, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False)
llm(prompt, max_tokens=4)
t0 = time.perf_counter(); llm(prompt, max_tokens=1); prefill = time.perf_counter() - t0
no_stop = {t: -1e9 for t in {llm.token_eos(), 0, 1, 2}}  # run the full length, as heron does
t0 = time.perf_counter(); out = llm(prompt, max_tokens=tokens, logit_bias=no_stop)
total = time.perf_counter() - t0
n = out["usage"]["completion_tokens"]
print(json.dumps({"tok_s": (n - 1) / (total - prefill), "tokens": n}))
"""


def llama_cpp_speed(python: str, gguf: Path, threads: int) -> float | None:
    if not python or not Path(python).exists():
        return None
    res = subprocess.run([python, "-c", LLAMA_SCRIPT, str(gguf), str(threads),
                          str(DECODE_TOKENS), DECODE_PROMPT], capture_output=True, text=True)
    if res.returncode:
        print("llama.cpp failed:", res.stderr[-500:])
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="/tmp/heron-quant-bench")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--llama-python", default="/tmp/llamacpp/bin/python")
    ap.add_argument("--skip-quantize", action="store_true", help="only fp32 and the GGUF")
    args = ap.parse_args()

    import torch

    from heron import LLM
    from heron.loader.gguf_loader import find_default_gguf

    torch.set_num_threads(args.threads)
    gguf = find_default_gguf()
    variants: dict[str, dict] = {"fp32 (GGUF dequantized)": {"quantization": "none"},
                                 "Q4_1 GGUF kept quantized": {},
                                 "Q4_1 GGUF, --cpu-int8-dot": {"cpu_int8_dot": True}}
    if not args.skip_quantize:
        for label, path in quantize_variants(Path(args.work), args.threads).items():
            variants[label] = {"model": str(path)}
    rows, chunks = [], None
    for label, kwargs in variants.items():
        llm = LLM(num_threads=args.threads, max_num_batched_tokens=2048, **kwargs)
        chunks = chunks or held_out_chunks(llm.get_tokenizer(), args.chunks, args.chunk_len)
        worker = llm.engine.core.executor.worker
        row = {"variant": label, "quantization": worker.quantization,
               "weight_mb": worker.weight_bytes / 1e6, "ppl": perplexity(llm, chunks),
               "decode_b1_tok_s": decode_speed(llm, 1)}
        if label in ("fp32 (GGUF dequantized)", "Q4_1 GGUF kept quantized",
                     "Q4_1 GGUF, --cpu-int8-dot"):
            row[f"decode_b{args.batch}_tok_s"] = decode_speed(llm, args.batch)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
    llama = llama_cpp_speed(args.llama_python, gguf, args.threads)
    report(rows, llama, args)
    return 0


def report(rows: list[dict], llama: float | None, args) -> None:
    base = rows[0]
    lines = [f"threads {args.threads}, held-out: {args.chunks} x {args.chunk_len} tokens of "
             f"hamlet, decode {DECODE_TOKENS} tokens", "",
             "| variant | stored as | weights MB | perplexity | delta | batch-1 tok/s | vs fp32 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        delta = 100 * (r["ppl"] / base["ppl"] - 1)
        lines.append(f"| {r['variant']} | {r['quantization']} | {r['weight_mb']:.0f} | "
                     f"{r['ppl']:.3f} | {delta:+.2f}% | {r['decode_b1_tok_s']:.1f} | "
                     f"{r['decode_b1_tok_s'] / base['decode_b1_tok_s']:.2f}x |")
    q4, int8 = rows[1], rows[2]
    key = f"decode_b{args.batch}_tok_s"
    lines += ["", f"batch {args.batch} decode: fp32 {base[key]:.1f} tok/s, Q4_1 kept "
                  f"{q4[key]:.1f} tok/s ({q4[key] / base[key]:.2f}x), with --cpu-int8-dot "
                  f"{int8[key]:.1f} tok/s ({int8[key] / base[key]:.2f}x)"]
    if llama is not None:
        lines.append(f"llama.cpp (llama-cpp-python, same GGUF, batch 1): {llama:.1f} tok/s; "
                     f"heron Q4_1 / llama.cpp = {q4['decode_b1_tok_s'] / llama:.2f}x")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quantization.md").write_text("# Quantization benchmark\n\n" + text + "\n")
    record = {"rows": rows, "llama_cpp_b1_tok_s": llama, "threads": args.threads}
    (RESULTS / "quantization.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    sys.exit(main())
