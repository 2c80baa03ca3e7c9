"""Everything GPU-related in one run of under 8 minutes: kernel precision, then two workloads.

    PYTHONPATH=. python benchmarks/gpu.py [--out-dir gpu-results]

1. ``heron check-kernels`` at real shapes (bf16 and fp32) against float64 references.
2. Llama-3.1-8B shape, bf16, random weights: batch 1, 512-token prompt, 128 new tokens;
   decode tok/s = 127 / (time of the last token - time of the first).
3. Qwen3-0.6B shape, bf16, random weights: 256 prompts of U[100, 1024] random tokens,
   512 output tokens each, EOS ignored; output tok/s over the whole run.
4. (``--phases llama,quant``, a second run of ~5 minutes) the Llama-3.1-8B decode of phase 2
   with quantized weights: W4A16 (a GPTQ 4-bit g128 config: the Triton dequant-GEMM) and FP8
   (``--quantization fp8``: per-channel weights, per-token activations, ``torch._scaled_mm``
   on Hopper), each with its speed-up over phase 2's bf16 (goals: >= 2.5x and >= 1.6x).

Each phase runs in its own process (clean GPU memory, its own time limit) and writes a JSON
file to ``--out-dir``; the parent prints a short table last and a JSON summary line. Models
are built from config.json files written to a temp dir (``load_format="dummy"``), so nothing
is downloaded; the offline path needs torch, triton, transformers and msgspec (no fastapi,
pyzmq or gguf). ``--smoke`` runs tiny shapes on whatever device exists (a CPU plumbing test).

The H200 image has no msgspec: download its Python 3.12 wheel here once, into the git-excluded
``.whl/`` (``echo /.whl/ >> .git/info/exclude``)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 -d .whl msgspec==0.23.0

then carry ``.whl`` and start the device command with
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
PYTHONPATH=/tmp/site:. python3 benchmarks/gpu.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOTAL_BUDGET_S = 470  # under 8 minutes, with the parent's own start-up
PHASE_BUDGET_S = {"check": 130, "llama": 150, "qwen": 180, "quant": 300}
NOT_ON_GPU_IMAGE = ("fastapi", "uvicorn", "zmq", "gguf")
# The engine's step messages are msgspec structs and the GPU image lacks msgspec: it travels
# as a wheel (see the module docstring).
CARRIED_WHEELS = ("msgspec",)
COPY_GBPS = 4232  # H200 copy bandwidth (read + write) measured 2026-11-29 (DESIGN.md)

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
W4A16_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
              "sym": True}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096)

# (workload, metric, issue baseline, goal, limit)
TABLE_ROWS = [
    ("llama", "decode_tok_s", "Llama-3.1-8B bs1 decode tok/s",
     "HF 53.6 eager / 138.7 compiled", ">= 240"),
    ("qwen", "output_tok_s", "Qwen3-0.6B 256 seqs output tok/s",
     "HF generate_batch 794", ">= 15000"),
    ("quant", "w4a16_speedup", "Llama-8B bs1 W4A16 / bf16", "bf16 (phase llama)", ">= 2.5"),
    ("quant", "fp8_speedup", "Llama-8B bs1 FP8 / bf16", "bf16 (phase llama)", ">= 1.6"),
]


# ---- phases (each runs in a child process) ------------------------------------------------
def _model_dir(config: dict, smoke: bool) -> str:
    config = {**config, **TINY} if smoke else config
    path = Path(tempfile.mkdtemp(prefix="heron-gpu-bench-"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _engine(config: dict, args, max_num_seqs: int, max_model_len: int, batched_tokens: int,
            quantization: str | None = None):
    from heron.config import EngineConfig, SchedulerConfig
    from heron.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=_model_dir(config, args.smoke), dtype=args.dtype, load_format="dummy",
        quantization=quantization,
        attention_backend=args.backend, enforce_eager=args.enforce_eager,
        max_model_len=max_model_len,
        scheduler=SchedulerConfig(max_num_batched_tokens=batched_tokens,
                                  max_num_seqs=max_num_seqs)))


def _run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[int]]:
    """Greedy, EOS ignored. Returns (time of each step that produced tokens, tokens per
    request); checks every request produced exactly max_tokens tokens."""
    from heron.engine.core_outputs import RequestOutputKind
    from heron.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.new_request_id() for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params, output_kind=RequestOutputKind.DELTA)
    times, counts = [], {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if outputs:
            times.append(time.perf_counter())
        for out in outputs:  # DELTA: only the new tokens, no per-step copy of the history
            counts[out.request_id] = counts.get(out.request_id, 0) + sum(
                len(c.token_ids) for c in out.outputs)
    got = [counts.get(i, 0) for i in ids]
    if set(got) != {max_tokens}:
        raise RuntimeError(f"expected {max_tokens} tokens per request, got {sorted(set(got))}")
    return times, got


def _random_prompts(num: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(rng.randint(low, high))]
            for _ in range(num)]


def _llama_decode(args, config: dict, quantization: str | None = None) -> dict:
    """Batch-1 decode on the Llama-3.1-8B shape (``config``: with or without a
    quantization_config)."""
    import torch

    from heron.loader.weights import model_weight_bytes

    prompt_len, new_tokens = (512, 128) if not args.smoke else (32, 8)
    vocab = LLAMA_8B["vocab_size"] if not args.smoke else TINY["vocab_size"]
    engine = _engine(config, args, max_num_seqs=8, max_model_len=1024, batched_tokens=2048,
                     quantization=quantization)
    _run(engine, _random_prompts(1, 16, 16, vocab, seed=1), 8)  # warm-up: compile, allocate
    prompt = _random_prompts(1, prompt_len, prompt_len, vocab, seed=2)
    start = time.perf_counter()
    times, _ = _run(engine, prompt, new_tokens)
    decode_s = times[-1] - times[0]
    params = model_weight_bytes(engine.runner.model)  # as the forward reads them
    # K and V of one token in every layer; caches are (2, blocks, block_size, KVH, D)
    kv_per_token = sum(c[:, 0, 0].numel() * c.element_size() for c in engine.runner.kv_caches)
    step_bytes = params + kv_per_token * (prompt_len + new_tokens / 2)  # weights + mean KV
    return dict(decode_tok_s=(new_tokens - 1) / decode_s, ttft_s=times[0] - start,
                limit_tok_s=COPY_GBPS * 1e9 / step_bytes, weight_bytes=params,
                backend=engine.runner.backend.name, graphs=engine.runner.graphs is not None,
                device=str(engine.runner.device),
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def phase_llama(args) -> dict:
    return _llama_decode(args, LLAMA_8B)


def phase_quant(args) -> dict:
    """W4A16 and FP8 decode, each against the bf16 figure phase llama wrote (when it ran)."""
    bf16_path = Path(args.out_dir) / "llama.json"
    bf16 = json.loads(bf16_path.read_text()).get("decode_tok_s") if bf16_path.is_file() else None
    w4a16 = _llama_decode(args, {**LLAMA_8B, "quantization_config": W4A16_GPTQ})
    fp8 = _llama_decode(args, LLAMA_8B, quantization="fp8")
    result = {"bf16_decode_tok_s": bf16, "w4a16": w4a16, "fp8": fp8}
    for name, run in (("w4a16", w4a16), ("fp8", fp8)):
        result[f"{name}_decode_tok_s"] = run["decode_tok_s"]
        result[f"{name}_weight_gb"] = run["weight_bytes"] / 1e9
        if bf16:
            result[f"{name}_speedup"] = run["decode_tok_s"] / bf16
    return result


def phase_qwen(args) -> dict:
    num, (low, high), out_len = (256, (100, 1024), 512) if not args.smoke else (8, (10, 40), 8)
    vocab = QWEN3_06B["vocab_size"] if not args.smoke else TINY["vocab_size"]
    engine = _engine(QWEN3_06B, args, max_num_seqs=256, max_model_len=2048,
                     batched_tokens=16384)
    _run(engine, _random_prompts(4, 16, 64, vocab, seed=3), 8)  # warm-up
    prompts = _random_prompts(num, low, high, vocab, seed=4)
    start = time.perf_counter()
    times, counts = _run(engine, prompts, out_len)
    elapsed = times[-1] - start
    return dict(output_tok_s=sum(counts) / elapsed, elapsed_s=elapsed,
                total_tok_s=(sum(counts) + sum(map(len, prompts))) / elapsed,
                num_steps=len(times), backend=engine.runner.backend.name,
                graphs=engine.runner.graphs is not None)


def phase_check(args) -> dict:
    from heron.entrypoints.check_kernels import add_parser, run
    from heron.kernels.check import SUITE

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    out = Path(args.out_dir) / "check_kernels.json"
    # the C++ CPU kernels are checked on CPU machines; GPU time is scarce
    gpu_kernels = ",".join(k for k in SUITE if not k.endswith("_cpu"))
    argv = ["check-kernels", "--json-out", str(out), "--dtypes", "bfloat16,float32",
            "--kernels", gpu_kernels]
    if args.smoke:
        argv += ["--kernels", "store_kv,rms_norm", "--dtypes", "float32"]
    rc = run(parser.parse_args(argv))
    report = json.loads(out.read_text())
    checks = report["checks"]
    return dict(rc=rc, passed=sum(c["ok"] for c in checks), total=len(checks),
                shapes="real" if report["real_shapes"] else "small",
                worst={f"{c['kernel']}/{c['dtype']}": c["max_rel_error"] for c in checks})


PHASES = {"check": phase_check, "llama": phase_llama, "qwen": phase_qwen, "quant": phase_quant}


def run_phase(args) -> int:
    if args.smoke:  # the GPU image lacks these: make sure nothing here needs them
        for name in NOT_ON_GPU_IMAGE:
            sys.modules[name] = None  # type: ignore[assignment]
    result = PHASES[args.phase](args)
    result["imported_but_absent_on_gpu_image"] = [
        n for n in NOT_ON_GPU_IMAGE if sys.modules.get(n) is not None]
    Path(args.out_dir, f"{args.phase}.json").write_text(json.dumps(result, indent=1))
    return 0


# ---- the parent: run phases under the time budget, print the table -------------------------
def run_all(args) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + TOTAL_BUDGET_S
    results: dict[str, dict] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH"))
        if p)}
    for phase in args.phases.split(","):
        left = deadline - time.monotonic()
        if left < 20:
            results[phase] = {"error": "skipped: out of time"}
            continue
        cmd = [sys.executable, __file__, "--phase", phase] + _child_flags(args)
        print(f"== {phase} (limit {min(PHASE_BUDGET_S[phase], left):.0f}s)", flush=True)
        results[phase] = _child(cmd, env, min(PHASE_BUDGET_S[phase], left),
                                out_dir / f"{phase}.json")
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    print(json.dumps({"gpu_bench": results}))
    return 0 if all("error" not in r for r in results.values()) else 1


def _child_flags(args) -> list[str]:
    flags = ["--out-dir", args.out_dir, "--dtype", args.dtype, "--backend", args.backend]
    return flags + (["--smoke"] if args.smoke else []) + (
        ["--enforce-eager"] if args.enforce_eager else [])


def _child(cmd: list[str], env: dict, timeout: float, result_path: Path) -> dict:
    result_path.unlink(missing_ok=True)
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if proc.returncode != 0 or not result_path.is_file():
        return {"error": f"exit code {proc.returncode}"}
    result = json.loads(result_path.read_text())
    result["wall_s"] = time.monotonic() - started
    return result


def print_table(results: dict[str, dict]) -> None:
    print()
    print(f"{'workload':<34} {'heron':>10} {'goal':>9} {'limit':>8}  baseline (issue)")
    for phase, key, label, baseline, goal in TABLE_ROWS:
        r = results.get(phase, {})
        digits = 2 if key.endswith("speedup") else 1
        value = f"{r[key]:.{digits}f}" if key in r else r.get("error", "-")[:10]
        limit = f"{r['limit_tok_s']:.0f}" if "limit_tok_s" in r else "-"
        print(f"{label:<34} {value:>10} {goal:>9} {limit:>8}  {baseline}")
    if "check" not in results:
        return
    check = results["check"]
    label = f"check-kernels ({check.get('shapes', '?')} shapes)"
    if "total" in check:
        worst = max(check["worst"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        print(f"{label:<34} {check['passed']:>4}/{check['total']:<5} "
              f"largest rel err {worst[1]:.1e} ({worst[0]})")
    else:
        print(f"{label:<34} {check.get('error', '-')}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default="gpu-results")
    p.add_argument("--phases", default="check,llama,qwen")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="auto", help="attention backend: auto | triton | torch")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: test the plumbing")
    p.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    args = p.parse_args()
    return run_phase(args) if args.phase else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
