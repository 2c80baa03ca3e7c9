"""Per-op CPU profile of heron and vLLM's CPU build on the same batched workload (issue 24).

Workload: ``--num-prompts`` prompts of ``--input-len`` random token ids, ``--output-len``
output tokens each, greedy, EOS ignored, on the fp32 HF directory of the default model
(``peer_model_dir(None)``), after a warm-up generate of 4 prompts x 8 tokens.

- heron: ``LLM(model_dir, num_threads=--threads)``; ``torch.profiler`` (CPU) around generate.
- vLLM: ``benchmarks/profile_ops_vllm.py`` in vLLM's venv, its own profiler
  (``profiler_config``, engine-core worker), once per binding: default (one core reserved for
  its scheduler) and ``VLLM_CPU_OMP_THREADS_BIND=0-(n-1)``.

Both traces are read the same way (``self_times``): each op's self time is its duration less
its direct children's, per thread; ops are grouped into categories (``CATEGORIES``). Only the
profiled threads' ops count: OpenMP worker threads inside a kernel are part of that kernel's
time. "host (not in ops)" is the wall time of generate not covered by any op's self time
(Python, scheduling, vLLM's front-end process, profiler overhead). ms/step divides by
``--output-len`` (one decode step per output token; prefill steps are included in the totals).

Writes ``benchmarks/results/profile_ops.md`` and ``.json``; prints the table and a JSON line.
"""

from __future__ import annotations

import argparse
import gc
import glob
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VLLM_SCRIPT = HERE / "profile_ops_vllm.py"

# (category, substrings of the op name, lower-cased); first match wins.
CATEGORIES = [
    ("fused (inductor)", ("cpp_fused", "graph_", "compiledfxgraph", "torch-compiled",
                          "compiledfunction", "inductor")),
    ("attention", ("attention", "attn", "write_kv", "reshape_and_cache", "paged",
                   "kv_cache", "sdpa")),
    ("linear/GEMM", ("linear", "addmm", "aten::mm", "aten::bmm", "matmul", "onednn",
                     "gemm", "mkldnn")),
    ("norms", ("norm",)),
    ("rotary", ("rotary", "rope")),
    ("activation", ("silu", "gelu", "act_and_mul", "sigmoid")),
    ("sampling/argmax", ("argmax", "sample", "topk", "top_k", "sort", "softmax", "max",
                         "multinomial", "gumbel", "penalt")),
    ("embedding", ("embedding", "index_select")),
]
OTHER, HOST = "other ops", "host (not in ops)"
ORDER = [c for c, _ in CATEGORIES] + [OTHER, HOST]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return OTHER


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def self_times(events: list[dict]) -> tuple[dict[str, float], int]:
    """Self time (us) per op name over the trace's ``cpu_op`` events, and how many threads
    ran ops. Annotations (``user_annotation``) nest ops but their own time is host time,
    except inductor's compiled-graph calls, whose self time is the fused kernels'."""
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out, threads = defaultdict(float), 0
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        threads += any(e["cat"] == "cpu_op" for e in evs)
        stack: list[list] = []  # [end_ts, event, children_us]
        for e in evs + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]):
                end, ev, kids = stack.pop()
                if ev["cat"] == "cpu_op" or category(ev["name"]) == "fused (inductor)":
                    out[ev["name"]] += max(ev["dur"] - kids, 0.0)
                if stack:
                    stack[-1][2] += ev["dur"]
            if e is not None:
                stack.append([e["ts"] + e["dur"], e, 0.0])
    return dict(out), threads


def summarize(ops: dict[str, float], wall_s: float, steps: int, threads: int) -> dict:
    """Category totals: ms, share of wall, ms per step; plus the top ops."""
    cats = defaultdict(float)
    for name, us in ops.items():
        cats[category(name)] += us / 1e3
    wall_ms = wall_s * 1e3
    cats[HOST] = max(wall_ms - sum(cats.values()), 0.0)
    table = {c: {"ms": round(cats.get(c, 0.0), 1), "share": round(cats.get(c, 0.0) / wall_ms, 4),
                 "ms_per_step": round(cats.get(c, 0.0) / steps, 3)} for c in ORDER}
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_s": round(wall_s, 3), "ms_per_step": round(wall_ms / steps, 2),
            "profiled_threads": threads, "categories": table,
            "top_ops": [{"name": n, "ms": round(us / 1e3, 1), "category": category(n)}
                        for n, us in top]}


def make_work(args) -> dict:
    rng = random.Random(args.seed)
    ids = lambda n, k: [[rng.randrange(100, 49000) for _ in range(k)] for _ in range(n)]
    return {"prompts": ids(args.num_prompts, args.input_len), "warmup": ids(4, args.input_len)}


def profile_heron(args, model_dir: Path, work: dict, tmp: Path) -> tuple[dict, list]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from heron import LLM, SamplingParams

    llm = LLM(str(model_dir), num_threads=args.threads)
    wrap = lambda ps: [{"prompt_token_ids": p} for p in ps]
    llm.generate(wrap(work["warmup"]), SamplingParams(temperature=0, max_tokens=8,
                                                      ignore_eos=True))
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        outs = llm.generate(wrap(work["prompts"]), sp)
        elapsed = time.perf_counter() - start
    trace = str(tmp / "heron.json")
    prof.export_chrome_trace(trace)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    del llm, prof
    gc.collect()
    ops, threads = self_times(load_trace(trace))
    rec = summarize(ops, elapsed, args.output_len, threads)
    return rec | {"engine": f"heron, {args.threads} torch threads"}, ids


def profile_vllm(args, model_dir: Path, prompts_json: Path, bind: str | None,
                 tmp: Path) -> tuple[dict, list]:
    from heron.bench.vllm_peer import BIND_ENV, default_venv

    name = "default" if bind is None else f"bind {bind}"
    trace_dir, result = tmp / f"vllm-{name.replace(' ', '_')}", tmp / f"{name}.json"
    env = dict(os.environ)
    env.pop(BIND_ENV, None)
    if bind is not None:
        env[BIND_ENV] = bind
    cmd = [str(default_venv() / "bin" / "python"), str(VLLM_SCRIPT), str(model_dir),
           str(prompts_json), str(trace_dir), str(result), str(args.output_len)]
    log = tmp / f"{name.replace(' ', '_')}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    traces = sorted(glob.glob(str(trace_dir / "**" / "*.pt.trace.json*"), recursive=True))
    if rc != 0 or not traces:
        raise RuntimeError(f"vLLM ({name}) failed (rc {rc}, {len(traces)} traces); see {log}")
    with open(result) as f:
        res = json.load(f)
    ops, threads = defaultdict(float), 0
    for t in traces:  # one per engine-core worker
        o, n = self_times(load_trace(t))
        threads += n
        for k, v in o.items():
            ops[k] += v
    rec = summarize(dict(ops), res["elapsed_s"], args.output_len, threads)
    return rec | {"engine": f"vLLM 0.32 CPU, {name}"}, res["outputs"]


def agreement(a: list, b: list) -> float:
    """Share of sequences whose first output token matches."""
    return round(sum(x[:1] == y[:1] for x, y in zip(a, b)) / max(len(a), 1), 3)


def render(records: dict[str, dict], args) -> str:
    names = list(records)
    head = "| category | " + " | ".join(f"{n}: ms/step (share)" for n in names) + " |"
    lines = [head, "|---" * (len(names) + 1) + "|"]
    for c in ORDER:
        cells = [f"{r['categories'][c]['ms_per_step']:.2f} ({r['categories'][c]['share']:.0%})"
                 for r in records.values()]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("| **wall** | " + " | ".join(
        f"**{r['ms_per_step']:.1f}** ({r['wall_s']:.1f} s, "
        f"{args.num_prompts * args.output_len / r['wall_s']:.0f} out tok/s)"
        for r in records.values()) + " |")
    return "\n".join(lines)


def write_results(records: dict, args, table: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    record = {"workload": vars(args), "engines": records, "categories": ORDER}
    (RESULTS / "profile_ops.json").write_text(json.dumps(record, indent=1) + "\n")
    tops = []
    for name, r in records.items():
        tops.append(f"\nTop ops, {name} ({r['engine']}; {r['profiled_threads']} profiled "
                    "threads):\n")
        tops += [f"- `{o['name']}` {o['ms']:.0f} ms ({o['category']})" for o in r["top_ops"]]
    md = [f"# Per-op profile: heron vs vLLM CPU, {args.num_prompts} x {args.input_len} / "
          f"{args.output_len} (`benchmarks/profile_ops.py`)", "",
          "Self CPU time of the profiled threads' ops, by category, per decode step "
          f"(total / {args.output_len}), with its share of the generate's wall time. "
          "\"host (not in ops)\" is wall time no op covers (Python, scheduling, vLLM's "
          "front-end process, profiler overhead). Profilers add overhead; compare shares, "
          "not throughputs (those are in `benchmarks/vs_vllm.py`'s results).", "", table, ""]
    (RESULTS / "profile_ops.md").write_text("\n".join(md + tops) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="heron's torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-vllm", action="store_true", help="profile heron only")
    p.add_argument("--vllm-from", help="take vLLM's rows from this earlier profile_ops.json "
                   "(same workload) and profile heron only")
    p.add_argument("--workdir", help="where traces and logs are kept (default: a new temp dir)")
    p.add_argument("--no-write", action="store_true", help="do not write results files")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from heron.bench.vllm_peer import bindings, peer_model_dir

    args = parse_args(argv)
    model_dir, work = peer_model_dir(None), make_work(args)
    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="profile_ops-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"traces and logs under {tmp}", file=sys.stderr, flush=True)
    prompts_json = tmp / "prompts.json"
    prompts_json.write_text(json.dumps(work))
    print("profiling heron", file=sys.stderr, flush=True)
    records, outputs = {}, {}
    records["heron"], outputs["heron"] = profile_heron(args, model_dir, work, tmp)
    if args.vllm_from:  # vLLM's records from an earlier run of this workload
        for name, rec in json.loads(Path(args.vllm_from).read_text())["engines"].items():
            if name != "heron":
                records[name] = rec
    for b in [] if args.no_vllm or args.vllm_from else bindings():
        print(f"profiling vLLM {b.name}", file=sys.stderr, flush=True)
        try:
            records[f"vLLM {b.name}"], outputs[b.name] = profile_vllm(
                args, model_dir, prompts_json, b.bind, tmp)
        except (RuntimeError, OSError, KeyError, ValueError) as e:
            print(f"vLLM {b.name}: {e}", file=sys.stderr, flush=True)
            continue
        records[f"vLLM {b.name}"]["first_token_agreement"] = agreement(
            outputs["heron"], outputs[b.name])
    table = render(records, args)
    print(table)
    print(json.dumps({n: {"ms_per_step": r["ms_per_step"], **{c: r["categories"][c]["share"]
                                                              for c in ORDER}}
                      for n, r in records.items()}))
    if not args.no_write:
        write_results(records, args, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
