"""`heron bench throughput`: offline, in-process batch throughput, heron and an optional peer.

Both engines get the same token-id prompts and output lengths (greedy, EOS ignored), each
after a small untimed warmup with other prompts; the peer runs after heron is freed. heron
runs on ``--threads`` (default: every core of this process's affinity). ``--peer vllm`` runs
vLLM twice, with its default thread binding and on every core (``vllm_peer.bindings``). The
record's ``results`` maps engine -> rates (each with its ``threads``); ``ratios`` is heron /
the stronger peer row (highest output tok/s), named in ``ratio_peer``. Importing this module
needs only torch and transformers (no server dependencies).
"""

from __future__ import annotations

import gc
import logging
import os

from heron.bench import parallel_stats
from heron.bench.heron_offline import HeronOffline, resolve_dtype
from heron.bench.machine import machine_info
from heron.bench.peer_compare import stronger
from heron.bench.results import emit
from heron.bench.table import format_table
from heron.bench.workloads import Sample, build_workload
from heron.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)

DEFAULTS = {"num_prompts": 256, "input_len": "100:1024", "output_len": "100:1024"}
RATE_KEYS = ("requests_per_s", "input_tok_s", "output_tok_s", "total_tok_s")


def _as_token_ids(samples: list[Sample], tokenizer) -> list[Sample]:
    """Text prompts (sharegpt) tokenized once, so every engine sees the same ids."""
    if all(isinstance(s.prompt, list) for s in samples):
        return samples
    if tokenizer is None:
        raise ValueError("text prompts need a model with a tokenizer (use --workload random)")
    return [Sample(tokenizer(s.prompt).input_ids, s.output_len) for s in samples]


def run_engine(engine, samples: list[Sample], warmup: list[Sample]) -> tuple[dict, list]:
    """Time one ``engine.generate`` over ``samples`` (the engine reports the seconds spent
    generating, setup excluded) after one over ``warmup``; fail if any request's output
    length is not the requested one (the engines would not have done the same work)."""
    if warmup:
        engine.generate(warmup)
    outputs, elapsed = engine.generate(samples)
    for i, (sample, out) in enumerate(zip(samples, outputs)):
        if len(out) != sample.output_len:
            raise RuntimeError(f"{engine.name}: request {i} produced {len(out)} tokens, expected "
                               f"{sample.output_len} (is --max-model-len too small?)")
    n_in, n_out = sum(len(s.prompt) for s in samples), sum(s.output_len for s in samples)
    return {"path": engine.path, "elapsed_s": elapsed, "num_requests": len(samples),
            "input_tokens": n_in, "output_tokens": n_out,
            "requests_per_s": len(samples) / elapsed, "input_tok_s": n_in / elapsed,
            "output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed}, outputs


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy sanity check between engines on the same weights."""
    pairs = list(zip(a, b))
    return {"identical_frac": sum(x == y for x, y in pairs) / len(pairs),
            "first_token_match_frac": sum(x[:1] == y[:1] for x, y in pairs) / len(pairs)}


def _peers(args, dtype: str, budget: dict, threads: int):
    """The peer configurations to run, one at a time: yields (engine, threads description)."""
    if args.peer == "vllm":
        from heron.bench.vllm_peer import VLLMPeer, bindings, peer_model_dir

        model_dir = peer_model_dir(args.model)
        for binding in bindings():
            yield VLLMPeer(model_dir, dtype, budget["max_model_len"], budget["max_num_seqs"],
                           budget["step_tokens"], prefix_caching=not args.no_prefix_caching,
                           binding=binding), binding.threads
        return
    from heron.bench.hf_peer import HFPeer

    yield HFPeer(args.model, args.load_format, dtype, args.peer_path, args.peer_batch_size,
                 kv_tokens=budget["kv_tokens"], step_tokens=budget["step_tokens"]), \
        f"{threads} torch threads"


def heron_threads(args) -> int:
    """``--threads``, else every core this process may run on (heron's engine default leaves
    one idle, which a peer given every core would not)."""
    return args.threads or len(os.sched_getaffinity(0))


def run_peers(args, dtype: str, budget: dict, threads: int, samples, warmup, results: dict,
              outputs: dict) -> list[str]:
    """Run every peer configuration after heron, adding to ``results`` / ``outputs``; the
    names it ran under."""
    names = []
    for peer, peer_threads in _peers(args, dtype, budget, threads):
        try:
            results[peer.name], outputs[peer.name] = run_engine(peer, samples, warmup)
        finally:
            peer.close()
        results[peer.name]["threads"] = peer_threads
        names.append(peer.name)
    return names


def run(args) -> dict:
    """Run the benchmark the parsed flags describe; print the table and JSON; return the
    record."""
    import torch

    threads = heron_threads(args)
    torch.set_num_threads(threads)
    machine, dtype = machine_info(), resolve_dtype(args.dtype)
    num = args.num_prompts or DEFAULTS["num_prompts"]
    heron = HeronOffline(args, num_threads=threads)
    tokenizer = heron.llm.get_tokenizer()
    count = (lambda text: len(tokenizer(text).input_ids)) if tokenizer is not None else None
    build = dict(vocab_size=heron.vocab_size, count_tokens=count, max_len=heron.max_model_len)
    samples = _as_token_ids(build_workload(args, num, **build), tokenizer)
    heron.check_fits(samples)
    warmup = [Sample(s.prompt, 8) for s in _as_token_ids(
        build_workload(args, min(4, num), seed_offset=1000, **build), tokenizer)]
    results, outputs = {}, {}
    heron.generate(warmup)
    before = parallel_stats.snapshot(heron.engine)
    spec_before = heron.engine.stats().spec_decode
    results["heron"], outputs["heron"] = run_engine(heron, samples, [])  # warmed up above
    results["heron"]["threads"] = f"{threads} torch threads"
    parallel = _parallel_report(heron, before, results["heron"]["elapsed_s"])
    spec = spec_decode_report(spec_before, heron.engine.stats().spec_decode)
    budget = {"kv_tokens": heron.kv_tokens, "step_tokens": heron.step_tokens,
              "max_model_len": heron.max_model_len,
              "max_num_seqs": heron.engine.config.scheduler.max_num_seqs}
    heron.close()
    del heron
    gc.collect()
    extra, ratios = {}, {}
    if args.peer != "none":
        names = run_peers(args, dtype, budget, threads, samples, warmup, results, outputs)
        best = stronger({n: results[n] for n in names})
        if args.load_format == "auto":
            extra = _agreement(outputs["heron"], outputs[best])
        ratios = {k: results["heron"][k] / results[best][k] for k in RATE_KEYS}
        extra["ratio_peer"] = best
    print_table(results, ratios, extra.get("ratio_peer"))
    if spec:
        print(f"speculative decoding: acceptance rate {spec['acceptance_rate']:.1%}, mean "
              f"acceptance length {spec['mean_acceptance_length']:.2f}, accepted per "
              f"position {spec['accepted_per_pos_rate']}")
        extra["spec_decode"] = spec
    if parallel:
        print(parallel_stats.format_report(parallel))
        extra["parallel"] = parallel
    record = {"kind": "throughput", "machine": machine, "config": _config(args, num, dtype) | {"threads": threads},
              "results": results, "ratios": ratios, **extra}
    emit(record, args.json_out)
    return record


def spec_decode_report(before: SpecDecodingStats | None,
                       after: SpecDecodingStats | None) -> dict | None:
    """Acceptance over the timed run (engine counters after minus before)."""
    if after is None:
        return None
    return after.since(before or SpecDecodingStats()).summary()


def _parallel_report(heron, before, elapsed_s: float) -> dict | None:
    """Communication and pipeline-bubble figures of the timed run (tp or pp > 1)."""
    if before is None:
        return None
    cfg, arch = heron.engine.config, heron.engine.arch
    after = parallel_stats.snapshot(heron.engine)
    return parallel_stats.report(before, after, elapsed_s, cfg.parallel.tensor_parallel_size,
                                 cfg.parallel.pipeline_parallel_size, arch.hidden_size,
                                 arch.num_layers, cfg.torch_dtype.itemsize)


def _config(args, num: int, dtype: str) -> dict:
    keys = ("model", "load_format", "workload", "prefix_len",
            "num_prefixes", "dataset", "seed", "max_num_batched_tokens", "max_num_seqs",
            "max_model_len", "threads", "peer", "no_prefix_caching", "attention_backend",
            "enforce_eager", "tensor_parallel_size", "pipeline_parallel_size",
            "context_parallel_size", "speculative_config")
    return {k: getattr(args, k, None) for k in keys} | {
        "num_prompts": num, "dtype": dtype,
        "input_len": args.input_len, "output_len": args.output_len or args._default_output}


def print_table(results: dict, ratios: dict, ratio_peer: str | None = None) -> None:
    """A column per engine row, and heron / ``ratio_peer`` (the stronger peer row)."""
    names = list(results)
    headers = ["metric", *names] + ([f"heron/{ratio_peer} (stronger)"] if ratios else [])
    rows = [[key, *(results[n][key] for n in names)]
            + ([f"{ratios[key]:.2f}x" if key in ratios else ""] if ratios else [])
            for key in ("elapsed_s", *RATE_KEYS)]
    rows.append(["threads", *(results[n].get("threads") for n in names)]
                + ([""] if ratios else []))
    print(format_table(headers, rows))
    for n in names:
        print(f"{n}: {results[n]['path']}")
