"""One decode step's attention with StreamingLLM requests (``heron/attention/streaming.py``)
against the same step with full KV, on SmolLM2-135M's attention shapes (9 query heads, 3 KV
heads, head_dim 64, 16-token blocks, shuffled block tables), float32.

Each workload is a batch of decodes at one context length:
  full       every request attends its whole context (the cpu backend's paged kernel)
  streaming  every request streams (sinks + window, ``--sinks``/``--window``): it reads only
             its sink and window keys
  mixed      half stream, half attend in full (the backend takes those)
A step runs ``--layers`` attention calls (each layer's KV store included) on a fresh
metadata, so the per-step plan is counted once per step, as in the engine. Both sides run
in interleaved rounds (a busy machine slows both alike); reported: median ms per step and
streaming / full (< 1: streaming is cheaper). Prints a table, then one JSON line.

On a shared machine, ``--threads 1 --clock thread`` times the calling thread's CPU time
instead of wall time (with one thread all the work runs there).

Usage: python benchmarks/streaming_decode.py [--contexts 2048,4096,8192] [--batch 16]
       [--sinks 4] [--window 256] [--layers 30] [--reps 10] [--backend cpu]
       [--threads N] [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from heron.attention import AttentionMetadata, get_attention_backend
from heron.attention.streaming import streaming_forward

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_pool(batch: int, context: int, seed: int = 0):
    """(kv_cache (2, N, bs, KVH, D), block_tables (B, max_blocks)) for ``batch`` sequences
    of ``context`` tokens each, random contents, shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq)
    return kv_cache, tables


def make_metadata(tables: torch.Tensor, context: int,
                  streaming: list[tuple[int, int] | None] | None) -> AttentionMetadata:
    """One decode per request, each the last of its ``context`` tokens."""
    batch = tables.shape[0]
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE  # (B,)
    return AttentionMetadata(
        slot_mapping=slots, block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.long),
        query_start_loc=torch.arange(batch + 1), query_start_loc_cpu=list(range(batch + 1)),
        query_lens_cpu=[1] * batch, seq_lens_cpu=[context] * batch, block_size=BLOCK_SIZE,
        streaming=streaming)


def step_fn(backend, kv_cache, tables, context, streaming, layers):
    """A closure running one step's ``layers`` attention calls."""
    batch = tables.shape[0]
    q = torch.randn(batch, HEADS, HEAD_DIM)
    q_sink = torch.randn(batch, HEADS, HEAD_DIM)
    k, v = torch.randn(batch, KV_HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM ** -0.5

    def run():
        md = make_metadata(tables, context, streaming)
        for _ in range(layers):
            if streaming is None:
                backend.forward(q, k, v, kv_cache, md, scale, None)
            else:
                streaming_forward(backend, q, q_sink, k, v, kv_cache, md, scale, None)
    return run


def timed(fn, clock) -> float:
    start = clock()
    fn()
    return 1000 * (clock() - start)


def measure(args, context: int) -> dict:
    kv_cache, tables = make_pool(args.batch, context)
    spec = (args.sinks, args.window)
    half = args.batch // 2
    cases = {"full": None, "streaming": [spec] * args.batch,
             "mixed": [spec] * half + [None] * (args.batch - half)}
    backend = get_attention_backend(args.backend)
    fns = {name: step_fn(backend, kv_cache, tables, context, s, args.layers)
           for name, s in cases.items()}
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm up (and build the kernels)
    for _ in range(args.reps):
        for name, fn in fns.items():
            times[name].append(timed(fn, args.clock))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"context": context, "batch": args.batch, "layers": args.layers,
            **{f"{name}_ms": round(ms, 3) for name, ms in med.items()},
            "streaming_over_full": round(med["streaming"] / med["full"], 3),
            "mixed_over_full": round(med["mixed"] / med["full"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: the calling thread's CPU time (use with --threads 1)")
    args = p.parse_args()
    args.clock = time.perf_counter if args.clock == "wall" else time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure(args, int(c)) for c in args.contexts.split(",") if c]
    clock = "wall" if args.clock is time.perf_counter else "thread CPU"
    print(f"{args.batch} decodes, sinks {args.sinks} + window {args.window}, {args.layers} "
          f"layers per step, backend {args.backend}, {torch.get_num_threads()} threads; "
          f"median {clock} ms per step")
    print(f"{'context':>8} {'full':>9} {'streaming':>10} {'mixed':>9} {'str/full':>9} "
          f"{'mix/full':>9}")
    for r in rows:
        print(f"{r['context']:>8} {r['full_ms']:>9.2f} {r['streaming_ms']:>10.2f} "
              f"{r['mixed_ms']:>9.2f} {r['streaming_over_full']:>9.3f} "
              f"{r['mixed_over_full']:>9.3f}")
    print(json.dumps({"benchmark": "streaming_decode", "sinks": args.sinks,
                      "window": args.window, "backend": args.backend, "clock": clock,
                      "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
