"""Prefix-cache benchmark: the same workloads with the cache on and off, in one run.

Workloads (token ids, greedy, EOS ignored):
  shared-system  32 users arrive together; each prompt = one 2,000-token system prompt plus a
                 short distinct question (20-40 tokens); 16 output tokens each.
  multi-turn     8 conversations x 4 turns after the same system prompt; turn k's prompt is
                 the whole history (questions and the model's own answers) plus a new question.
Reports, per workload and mode: prompt tokens, prefill tokens actually computed, cache-hit
tokens, mean / p50 / p90 TTFT (arrival to first token, in-process), wall time; then the
reductions (goal: >= 90% fewer prefill tokens, >= 5x lower mean TTFT), checks that both modes
produced identical tokens, and prints one JSON line.

Usage: python benchmarks/prefix_cache.py [--users 32 --system-len 2000 --json-out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

from heron import LLM, SamplingParams


def shared_system_workload(rng, users: int, system_len: int) -> list[list[int]]:
    system = [rng.randrange(100, 49000) for _ in range(system_len)]
    return [system + [rng.randrange(100, 49000) for _ in range(rng.randint(20, 40))]
            for _ in range(users)]


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list, list[float]]:
    """Submit every prompt at once, step to completion; (token lists, TTFTs in s)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = []
    for prompt in prompts:
        ids.append(engine.new_request_id())
        engine.add_request(ids[-1], prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    outs = [finals[i] for i in ids]
    ttfts = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    return [o.outputs[0].token_ids for o in outs], ttfts


def shared_system(llm, args, rng) -> tuple[list, list[float]]:
    return run_batch(llm, shared_system_workload(rng, args.users, args.system_len),
                     args.output_len)


def multi_turn(llm, args, rng) -> tuple[list, list[float]]:
    system = [rng.randrange(100, 49000) for _ in range(args.system_len)]
    histories = [list(system) for _ in range(args.conversations)]
    tokens, ttfts = [], []
    for _ in range(args.turns):
        for history in histories:
            history += [rng.randrange(100, 49000) for _ in range(rng.randint(10, 30))]
        answers, turn_ttfts = run_batch(llm, histories, args.answer_len)
        for history, answer in zip(histories, answers):
            history += answer
        tokens += answers
        ttfts += turn_ttfts
    return tokens, ttfts


WORKLOADS = {"shared-system": shared_system, "multi-turn": multi_turn}


def measure(workload: str, enable: bool, args) -> dict:
    llm = LLM(max_model_len=args.max_model_len, max_num_seqs=max(args.users, 8),
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=enable)
    before = llm.engine.stats()
    start = time.perf_counter()
    tokens, ttfts = WORKLOADS[workload](llm, args, random.Random(args.seed))
    wall = time.perf_counter() - start
    after = llm.engine.stats()
    del llm
    gc.collect()
    ttfts_sorted = sorted(ttfts)
    return {
        "workload": workload, "prefix_cache": enable, "requests": len(ttfts),
        "prompt_tokens": after.prefix_cache.queries - before.prefix_cache.queries
        if enable else None,
        "prefill_tokens": after.scheduler.num_prefill_tokens - before.scheduler.num_prefill_tokens,
        "hit_tokens": after.prefix_cache.hits - before.prefix_cache.hits,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts_sorted[len(ttfts) // 2],
        "ttft_p90_s": ttfts_sorted[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "wall_s": wall, "tokens": tokens,
    }


def compare(on: dict, off: dict) -> dict:
    return {
        "workload": on["workload"],
        "prefill_reduction": 1 - on["prefill_tokens"] / off["prefill_tokens"],
        "ttft_speedup": off["ttft_mean_s"] / on["ttft_mean_s"],
        "wall_speedup": off["wall_s"] / on["wall_s"],
        "identical_outputs": on["tokens"] == off["tokens"],
    }


def print_table(rows: list[dict], ratios: list[dict]) -> None:
    print(f"{'workload':<14} {'cache':<5} {'reqs':>4} {'prefill tok':>11} {'hit tok':>8} "
          f"{'TTFT mean':>9} {'p50':>7} {'p90':>7} {'wall s':>7}")
    for r in rows:
        print(f"{r['workload']:<14} {'on' if r['prefix_cache'] else 'off':<5} {r['requests']:>4} "
              f"{r['prefill_tokens']:>11} {r['hit_tokens']:>8} {r['ttft_mean_s']:>8.3f}s "
              f"{r['ttft_p50_s']:>6.3f}s {r['ttft_p90_s']:>6.3f}s {r['wall_s']:>7.1f}")
    for c in ratios:
        print(f"{c['workload']}: {100 * c['prefill_reduction']:.1f}% fewer prefill tokens "
              f"(goal >= 90%), mean TTFT {c['ttft_speedup']:.1f}x lower (goal >= 5x), "
              f"wall {c['wall_speedup']:.1f}x, identical outputs: {c['identical_outputs']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--system-len", type=int, default=2000)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    rows, ratios = [], []
    for workload in args.workloads:
        pair = {}
        for enable in (True, False):
            print(f"running {workload} with the prefix cache {'on' if enable else 'off'}...",
                  file=sys.stderr, flush=True)
            pair[enable] = measure(workload, enable, args)
        rows += [pair[True], pair[False]]
        ratios.append(compare(pair[True], pair[False]))
    print_table(rows, ratios)
    record = {
        "benchmark": "prefix_cache", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(), "args": vars(args),
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows], "ratios": ratios,
    }
    line = json.dumps(record)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    return 0 if all(c["identical_outputs"] for c in ratios) else 1


if __name__ == "__main__":
    sys.exit(main())
