"""One layer of CPU prefill attention: the torch reference path (gather each sequence's pages
into a padded tensor + SDPA with an offset causal mask, ``heron/attention/torch_backend.py``)
against heron's C++ paged attention kernel (``heron/attention/cpu_backend.py``).

Shapes are SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64) over a paged
cache of 16-token blocks with shuffled block tables. Each workload is one step's flat batch:
  1x512           one fresh 512-token prompt
  4x256+256       four 256-token chunks, each after a 256-token cached prefix
  16x128          sixteen fresh 128-token prompts
and, to check the routing beyond those three: a long prompt, a small chunk, a chunk after a
long prefix, a mixed step (one prefill chunk + 32 decodes) and the 1x512 step in bfloat16.
Both sides run the backend's whole ``forward`` (KV store included, the same in both), in
interleaved rounds so a busy machine slows both alike; reported: median ms per layer and
torch / kernel (> 1: the kernel is faster). Prints a table, then one JSON line.

On a shared machine, ``--threads 1 --clock thread`` times the calling thread's CPU time
instead of wall time (with one thread all the work runs there): other processes then cost
neither side anything but cache.

Usage: python benchmarks/cpu_prefill_attention.py [--reps 20] [--threads N]
       [--clock wall|thread] [--workloads 1x512,...] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from heron.attention import AttentionMetadata, get_attention_backend
from heron.kernels import cases, cpu

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16

# name -> (q_lens, seq_lens, dtype); request i's queries are the last q_lens[i] of its
# seq_lens[i] positions (seq_len > q_len: a chunk after a cached prefix)
WORKLOADS = {
    "1x512": ([512], [512], torch.float32),
    "4x256+256": ([256] * 4, [512] * 4, torch.float32),
    "16x128": ([128] * 16, [128] * 16, torch.float32),
    "1x2048": ([2048], [2048], torch.float32),
    "1x32": ([32], [32], torch.float32),
    "1x128+2000": ([128], [2128], torch.float32),
    "256+32 decodes": ([256] + [1] * 32, [256] + list(range(300, 940, 20)), torch.float32),
    "1x512 bf16": ([512], [512], torch.bfloat16),
}


def make_step(q_lens: list[int], seq_lens: list[int], dtype: torch.dtype):
    """(q, k, v, kv_cache, metadata) of one layer's step over a cache with random contents."""
    case = cases.attention_case(q_lens, seq_lens, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM,
                                BLOCK_SIZE, dtype, seed=0)
    starts, seq_lens_t, tables = case.device_tensors()
    slots = [case.block_tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (q, s) in enumerate(zip(q_lens, seq_lens)) for p in range(s - q, s)]
    k = cases.randn(sum(q_lens), KV_HEADS, HEAD_DIM, dtype=dtype, seed=1)
    v = cases.randn(sum(q_lens), KV_HEADS, HEAD_DIM, dtype=dtype, seed=2)
    md = AttentionMetadata(torch.tensor(slots), tables, seq_lens_t, starts, case.query_start_loc,
                           list(q_lens), list(seq_lens), BLOCK_SIZE)
    kv_cache = torch.stack([case.key_cache, case.value_cache])
    return case.q, k, v, kv_cache, md


def time_workload(q_lens, seq_lens, dtype, reps: int, clock=time.perf_counter) -> dict:
    """Median ms of each backend's forward, in alternating rounds after one warmup each."""
    q, k, v, kv_cache, md = make_step(q_lens, seq_lens, dtype)
    backends = {name: get_attention_backend(name) for name in ("torch", "cpu")}
    scale = HEAD_DIM ** -0.5
    outs, times = {}, {name: [] for name in backends}
    for name, backend in backends.items():  # warmup; also builds the torch path's plan
        outs[name] = backend.forward(q, k, v, kv_cache, md, scale)
    for _ in range(reps):
        for name, backend in backends.items():
            start = clock()
            backend.forward(q, k, v, kv_cache, md, scale)
            times[name].append(1e3 * (clock() - start))
    torch_ms, kernel_ms = (statistics.median(times[n]) for n in ("torch", "cpu"))
    diff = (outs["cpu"].double() - outs["torch"].double()).abs().max().item()
    return dict(tokens=sum(q_lens), torch_ms=torch_ms, kernel_ms=kernel_ms,
                speedup=torch_ms / kernel_ms,
                max_rel_diff=diff / outs["torch"].double().abs().max().item())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20, help="timed rounds per workload")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: the calling thread's CPU time (needs --threads 1)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if not cpu.load():
        print("heron's C++ CPU kernel did not build here; nothing to compare")
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        p.error("--clock thread needs --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    print(f"one attention layer: {HEADS} heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
          f"block {BLOCK_SIZE}; {torch.get_num_threads()} threads; {args.clock} time, median of "
          f"{args.reps}")
    print(f"{'workload':<16} {'tokens':>6} {'torch ms':>9} {'kernel ms':>10} {'torch/kernel':>13}"
          f" {'max rel diff':>13}")
    rows = {}
    for name in args.workloads.split(","):
        q_lens, seq_lens, dtype = WORKLOADS[name]
        r = rows[name] = time_workload(q_lens, seq_lens, dtype, args.reps, clock)
        print(f"{name:<16} {r['tokens']:>6} {r['torch_ms']:>9.2f} {r['kernel_ms']:>10.2f} "
              f"{r['speedup']:>12.2f}x {r['max_rel_diff']:>13.1e}", flush=True)
    record = dict(benchmark="cpu_prefill_attention", threads=torch.get_num_threads(),
                  clock=args.clock, reps=args.reps,
                  machine=platform.processor() or platform.machine(), torch=torch.__version__,
                  workloads=rows)
    line = json.dumps(record)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
