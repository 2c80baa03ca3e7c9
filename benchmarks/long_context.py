"""Long context: perplexity vs position, KV memory and decode speed vs context, StreamingLLM vs
recomputation, the longest context at a fixed KV budget, and llama.cpp's context shift.

    .venv/bin/python benchmarks/long_context.py            # default sizes: 40 min on 2 shared
                                                           # cores at load 2-8 (2026-12-03)
    .venv/bin/python benchmarks/long_context.py --quick    # a smoke run (a few minutes)
    .venv/bin/python benchmarks/long_context.py --parts ppl --models smollm2 --ppl-len 8192

Parts (``--parts``, comma-separated; every one but ``cp`` by default):
  ppl        perplexity in position buckets on Shakespeare's plays concatenated (the
             ``shakespeare`` package), from prompt logprobs, per mode: plain attention (past
             the trained length with max_position_embeddings overridden), dynamic NTK and YaRN
             (``hf_overrides``, only where the text is longer than the trained length), and
             StreamingLLM with 4 sink tokens and without (``streaming_kv``, the long tail).
  memory     KV held (pool blocks in use, and bytes) and decode tokens/s vs context length:
             full attention, a sliding window (SmolLM2 with ``{"sliding_window": W}``;
             Gemma 3's own 15 local layers), sinks + window (StreamingLLM).
  recompute  StreamingLLM's cached decode vs a sliding window with recomputation (each
             generated token recomputes the last W tokens from scratch: a fresh W-token
             prefill, prefix cache off), per-token latency and ratio (the paper's 22.2x row).
  budget     a fixed KV budget (the KV of ``--budget-tokens`` tokens of the model with every
             layer full): the longest context each mode accepts, and which lengths complete.
  llamacpp   llama.cpp's llama-server (``.venv/peers/llama``) on the same GGUF with a small
             ``--ctx-size`` and ``--context-shift`` vs without: generating past the context,
             tokens/s and whether it keeps going; heron's StreamingLLM on the same file beside.
  cp         context parallelism: prefill time of one ``--cp-len`` prompt at 1, 2, 4 ranks,
             with each rank's communication time (``--parts cp``; not in the default run:
             its ranks share this machine's cores).

Models: SmolLM2-135M-Instruct (the embedded Q4_1 GGUF, ``LLM(None)``, trained to 8,192) and
Gemma 3 270M (``find_gemma3_270m_gguf()``, 18 layers, 15 local with window 512, trained to
32,768). Weights are dequantized to float32 (``--quantization none``, the faster prefill path
on CPU) except in the llama.cpp part, which keeps the GGUF quantized like llama.cpp does.
Greedy, EOS ignored. Results go to benchmarks/results/long_context.{json,md} and plots
long_context_*.png; one JSON line on stdout. The machine's load average is recorded before
each part (this machine is shared: compare modes within a run, not absolute times).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from heron import LLM, SamplingParams
from heron.bench.machine import machine_info, machine_summary
from heron.bench.table import fmt, format_table

RESULTS = Path("benchmarks/results")
PARTS = ("ppl", "memory", "recompute", "budget", "llamacpp", "cp")
# cp is opt-in: N ranks on a 2-core machine oversubscribe it
DEFAULT_PARTS = PARTS[:-1]
SINKS = 4

# per model: native context, KV bytes per token with every layer full (float32), whether
# rope extension modes (dynamic NTK, YaRN with rope_scaling) apply
MODELS = {
    "smollm2": {"title": "SmolLM2-135M-Instruct (Q4_1 GGUF)", "native": 8192,
                "kv_bytes_per_token": 2 * 30 * 3 * 64 * 4, "extend": True},
    "gemma3": {"title": "Gemma 3 270M (Q4_K_M GGUF)", "native": 32768,
               "kv_bytes_per_token": 2 * 18 * 1 * 256 * 4, "extend": False},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {msg}",
          file=sys.stderr, flush=True)


def model_path(name: str) -> str | None:
    if name == "smollm2":
        return None  # the embedded SmolLM2-135M-Instruct GGUF
    from heron.loader.packaged_gguf import find_gemma3_270m_gguf

    return str(find_gemma3_270m_gguf())


# ---- engines: one at a time, reused while the next part asks for the same one -----------
class Engines:
    """Builds ``LLM``s on demand and keeps the last one, so parts that can share an engine
    (per-request modes) do not pay another load (Gemma 3's takes ~30-50 s here)."""

    def __init__(self, args) -> None:
        self.args, self.key, self.llm = args, None, None
        self.load_s: list[tuple[str, float]] = []

    def get(self, model: str, **kwargs) -> LLM:
        kwargs = {"quantization": self.args.quantization, "max_num_seqs": 1,
                  "num_threads": self.args.threads} | kwargs
        key = (model, json.dumps(kwargs, sort_keys=True, default=str))
        if key != self.key:
            self.close()
            log(f"loading {model} {kwargs}")
            start = time.perf_counter()
            self.llm = LLM(model_path(model), **kwargs)
            self.load_s.append((f"{model} {kwargs}", time.perf_counter() - start))
            self.key = key
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.engine.shutdown()
        self.llm, self.key = None, None
        gc.collect()


_TEXT: dict[str, list[int]] = {}


def text_ids(llm: LLM, model: str, n: int) -> list[int]:
    """The first ``n`` tokens of the plays concatenated (sorted file order), with the BOS
    token where the model's tokenizer adds one (Gemma 3 needs it)."""
    if len(_TEXT.get(model, [])) < n:
        from heron.training.draft_data import shakespeare_texts

        tok, parts, ids = llm.get_tokenizer(), [], []
        for path in shakespeare_texts():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
            if sum(len(p) for p in parts) > 5 * n:
                ids = tok("\n\n".join(parts))["input_ids"]
                if len(ids) >= n:
                    break
        if len(ids) < n:
            raise ValueError(f"the plays hold {len(ids)} tokens, fewer than {n}")
        _TEXT[model] = list(ids)
    return _TEXT[model][:n]


def run_one(llm: LLM, prompt: list[int], params: SamplingParams) -> dict:
    """One request stepped to completion: wall times, tokens, and the pool blocks in use after
    each step (peak during prefill and during decode; the request runs alone)."""
    engine, kv = llm.engine, llm.engine.kv_cache
    rid = engine.new_request_id()
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    first = final = None
    n = prefill_peak = decode_peak = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        mine = [o for o in outs if o.request_id == rid]
        held = kv.num_blocks - kv.num_free_blocks
        for o in mine:
            n = len(o.outputs[0].token_ids)
            final = o if o.finished else final
        if first is None:
            prefill_peak = max(prefill_peak, held)
            if n:
                first = now
        elif final is None:
            decode_peak = max(decode_peak, held)
    end = time.perf_counter()
    decode_s = end - first if first else None
    return {"wall_s": end - start, "prefill_s": (first or end) - start, "tokens": n,
            "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s else None,
            "decode_ms_per_token": 1000 * decode_s / (n - 1) if n > 1 and decode_s else None,
            "prefill_peak_blocks": prefill_peak, "decode_peak_blocks": decode_peak,
            "output": final}


def pool_block_bytes(llm: LLM) -> int:
    """Bytes of one pool block: K and V of ``block_size`` tokens in each layer a block holds
    (a KV-group's size; all layers for a model whose layers are alike), float32."""
    core = llm.engine.core
    return (2 * core.kv_cache.groups.group_size * core.kv_cache.block_size
            * core.arch.num_kv_heads * core.arch.head_dim * 4)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def stream_spec(window: int, sinks: int = SINKS) -> dict:
    return {"sink_tokens": sinks, "window": window}


def mpe_override(native: int, length: int) -> dict:
    """Plain attention past the trained length: heron checks max_model_len against
    max_position_embeddings, so raise it (the rope itself is unchanged)."""
    return {"max_position_embeddings": length} if length > native else {}


# ---- part 1: perplexity vs position -----------------------------------------------------
def ppl_lengths(model: str, args) -> tuple[int, int]:
    """(tokens of the full-attention modes, tokens of the StreamingLLM modes)."""
    if model == "smollm2":
        return args.ppl_len, args.stream_len
    return args.gemma_ppl_len, args.gemma_stream_len


def main_engine(model: str, args) -> dict:
    """The engine the ppl part's plain and StreamingLLM modes and the memory part's full and
    sinks + window modes share (StreamingLLM per request): long enough for all of them."""
    native = MODELS[model]["native"]
    top = max(*ppl_lengths(model, args), max(args.contexts) + args.decode_tokens + 16)
    return {"max_model_len": top, "max_num_batched_tokens": args.ppl_chunk[model],
            "hf_overrides": mpe_override(native, top) or None}


def ppl_modes(model: str, args) -> list[dict]:
    """(label, engine kwargs, per-request streaming_kv, tokens) per mode; modes that share
    engine kwargs run on one engine."""
    spec, native = MODELS[model], MODELS[model]["native"]
    full_len, stream_len = ppl_lengths(model, args)
    main = main_engine(model, args)
    plain = "plain" if full_len <= native else f"plain past {native:,}"
    modes = []  # the extension modes first: their engines load once, then the main one
    if spec["extend"] and full_len > native:
        factor = float(math.ceil(full_len / native))
        for label, rope in (("dynamic NTK", {"rope_type": "dynamic", "factor": factor}),
                            ("YaRN", {"rope_type": "yarn", "factor": factor,
                                      "original_max_position_embeddings": native})):
            modes.append({"mode": f"{label} x{factor:g}", "streaming": None, "len": full_len,
                          "engine": {"max_model_len": full_len,
                                     "max_num_batched_tokens": args.ppl_chunk[model],
                                     "hf_overrides": {"rope_scaling": rope}}})
    w = args.stream_window
    modes += [{"mode": plain, "engine": main, "streaming": None, "len": full_len},
              {"mode": f"{SINKS} sinks + window {w - SINKS}", "engine": main,
               "streaming": stream_spec(w - SINKS), "len": stream_len},
              {"mode": f"window {w} (no sinks)", "engine": main,
               "streaming": stream_spec(w, 0), "len": stream_len}]
    return modes


def bucketed(lps: list[float], size: int) -> list[dict]:
    """Perplexity per ``size``-token bucket of positions (``lps[i]``: token i + 1's)."""
    out = []
    for start in range(0, len(lps) + 1, size):
        chunk = lps[max(0, start - 1):start - 1 + size] if start else lps[:size - 1]
        if chunk:
            out.append({"start": start, "end": start + size, "tokens": len(chunk),
                        "ppl": math.exp(-sum(chunk) / len(chunk))})
    return out


def part_ppl(engines: Engines, args, model: str) -> list[dict]:
    rows = []
    for m in ppl_modes(model, args):
        log(f"ppl {model}: {m['mode']}, {m['len']:,} tokens")
        llm = engines.get(model, **m["engine"])
        ids = text_ids(llm, model, m["len"] - 16)  # room for max_model_len checks
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, streaming_kv=m["streaming"])
        r = run_one(llm, ids, params)
        entries = r["output"].prompt_logprobs
        lps = [entries[i][ids[i]][0] for i in range(1, len(ids))]
        rows.append({"model": model, "mode": m["mode"], "tokens": len(ids),
                     "ppl": math.exp(-sum(lps) / len(lps)), "wall_s": r["wall_s"],
                     "tok_s": len(ids) / r["wall_s"], "buckets": bucketed(lps, args.bucket),
                     "hf_overrides": m["engine"].get("hf_overrides"),
                     "streaming_kv": m["streaming"]})
        log(f"  ppl {rows[-1]['ppl']:.2f} in {r['wall_s']:.1f} s")
    return rows


# ---- part 2: KV held and decode speed vs context ----------------------------------------
def memory_modes(model: str, args) -> list[dict]:
    native, w = MODELS[model]["native"], args.window
    base = main_engine(model, args)
    top = base["max_model_len"]
    if model == "smollm2":
        sliding = base | {"max_num_batched_tokens": args.chunk,
                          "hf_overrides": {"sliding_window": w} | mpe_override(native, top)}
        return [{"mode": "full attention", "engine": base, "streaming": None},
                {"mode": f"{SINKS} sinks + window {w - SINKS}", "engine": base,
                 "streaming": stream_spec(w - SINKS)},
                {"mode": f"sliding window {w} (hf_overrides)", "engine": sliding,
                 "streaming": None}]
    return [{"mode": "3 full + 15 sliding-512 layers (native)", "engine": base,
             "streaming": None},
            {"mode": f"{SINKS} sinks + window {w - SINKS} (+ local 512)", "engine": base,
             "streaming": stream_spec(w - SINKS)}]


def part_memory(engines: Engines, args, model: str) -> list[dict]:
    rows = []
    for m in memory_modes(model, args):
        llm = engines.get(model, **m["engine"])
        block_bytes = pool_block_bytes(llm)
        for ctx in args.contexts:
            if ctx + args.decode_tokens > llm.engine.core.max_model_len:
                continue
            log(f"memory {model}: {m['mode']}, context {ctx:,}")
            ids = text_ids(llm, model, ctx)
            r = run_one(llm, ids, greedy(args.decode_tokens, streaming_kv=m["streaming"]))
            full = MODELS[model]["kv_bytes_per_token"] * (ctx + args.decode_tokens)
            rows.append({"model": model, "mode": m["mode"], "context": ctx,
                         "decode_tokens": r["tokens"], "decode_tok_s": r["decode_tok_s"],
                         "decode_ms_per_token": r["decode_ms_per_token"],
                         "prefill_s": r["prefill_s"],
                         "blocks_held": r["decode_peak_blocks"],
                         "prefill_peak_blocks": r["prefill_peak_blocks"],
                         "kv_mb_held": r["decode_peak_blocks"] * block_bytes / 1e6,
                         "full_kv_mb": full / 1e6, "pool_block_bytes": block_bytes})
    return rows


# ---- part 3: StreamingLLM vs a sliding window with recomputation ------------------------
def part_recompute(engines: Engines, args) -> list[dict]:
    model, rows = "smollm2", []
    top = max(args.recompute_windows) + 64 + args.recompute_tokens + 16
    llm = engines.get(model, max_model_len=top, enable_prefix_caching=False,
                      max_num_batched_tokens=max(2048, max(args.recompute_windows)))
    for w in args.recompute_windows:
        log(f"recompute: window {w}")
        prompt = text_ids(llm, model, w)
        run_one(llm, prompt[:64], greedy(1))  # warm
        recompute = [run_one(llm, prompt, greedy(1))["wall_s"] for _ in range(args.reps)]
        long_prompt = text_ids(llm, model, w + 64)  # evicting from the first decode step
        stream = run_one(llm, long_prompt, greedy(args.recompute_tokens,
                                                  streaming_kv=stream_spec(w - SINKS)))
        full = run_one(llm, long_prompt, greedy(args.recompute_tokens))
        per_token = 1000 * statistics.median(recompute)
        rows.append({"window": w, "recompute_ms_per_token": per_token,
                     "recompute_samples_ms": [1000 * s for s in recompute],
                     "streaming_ms_per_token": stream["decode_ms_per_token"],
                     "full_kv_ms_per_token": full["decode_ms_per_token"],
                     "speedup": per_token / stream["decode_ms_per_token"]})
        log(f"  recompute {per_token:.1f} ms vs streaming "
            f"{stream['decode_ms_per_token']:.2f} ms: {rows[-1]['speedup']:.1f}x")
    return rows


# ---- part 4: the longest context at a fixed KV budget -----------------------------------
def budget_modes(model: str, args) -> list[dict]:
    w, top = args.window, max(args.budget_multiples) * args.budget_tokens
    native = MODELS[model]["native"]
    if model == "smollm2":
        return [{"mode": "full attention", "engine": {}, "bounded": True},
                {"mode": f"sliding window {w}", "bounded": False, "engine": {
                    "max_model_len": top,
                    "hf_overrides": {"sliding_window": w} | mpe_override(native, top)}},
                {"mode": f"{SINKS} sinks + window {w - SINKS}", "bounded": False,
                 "engine": {"max_model_len": top, "streaming_kv": stream_spec(w - SINKS)}}]
    return [{"mode": "3 full + 15 sliding-512 layers (native)", "engine": {}, "bounded": True},
            {"mode": f"{SINKS} sinks + window {w - SINKS} (+ local 512)", "bounded": False,
             "engine": {"max_model_len": top, "streaming_kv": stream_spec(w - SINKS),
                        "hf_overrides": mpe_override(native, top) or None}}]


def part_budget(engines: Engines, args, model: str) -> list[dict]:
    rows = []
    budget_bytes = args.budget_tokens * MODELS[model]["kv_bytes_per_token"]
    for m in budget_modes(model, args):
        # the pool: the bytes of budget_tokens tokens of the all-full model (a few bytes
        # over, so that float rounding does not drop a block)
        gb = (budget_bytes + 64) / 2**30
        kwargs = {"kv_cache_memory_gb": gb, "max_num_batched_tokens": args.chunk,
                  "enable_prefix_caching": False} | m["engine"]
        log(f"budget {model}: {m['mode']}")
        try:
            llm = engines.get(model, **kwargs)
        except ValueError as e:
            rows.append({"model": model, "mode": m["mode"], "error": str(e)})
            continue
        blocks = llm.engine.kv_cache.num_blocks
        row = {"model": model, "mode": m["mode"], "num_kv_blocks": blocks,
               "pool_mb": blocks * pool_block_bytes(llm) / 1e6,
               "max_model_len": llm.engine.core.max_model_len,
               "bounded_by_pool": m["bounded"], "runs": []}
        for mult in args.budget_multiples:
            target = mult * args.budget_tokens
            run = {"length": target}
            if target > llm.engine.core.max_model_len:
                try:  # what the engine says to a request longer than it serves
                    run_one(llm, text_ids(llm, model, target - args.decode_tokens),
                            greedy(args.decode_tokens))
                except ValueError as e:
                    run |= {"completed": False, "refused": str(e)[:300]}
                row["runs"].append(run)
                continue
            log(f"  length {target:,}")
            pre = llm.engine.scheduler.stats.num_preemptions
            r = run_one(llm, text_ids(llm, model, target - args.decode_tokens),
                        greedy(args.decode_tokens, streaming_kv=None))
            run |= {"completed": r["tokens"] == args.decode_tokens, "wall_s": r["wall_s"],
                    "peak_blocks": max(r["prefill_peak_blocks"], r["decode_peak_blocks"]),
                    "decode_tok_s": r["decode_tok_s"],
                    "preemptions": llm.engine.scheduler.stats.num_preemptions - pre}
            row["runs"].append(run)
        rows.append(row)
    return rows


# ---- part 5: llama.cpp's context shift --------------------------------------------------
def _llama_generate(url: str, prompt: list[int], n: int, timeout: float) -> dict:
    import httpx

    body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0,
            "n_keep": SINKS, "cache_prompt": False}
    start = time.perf_counter()
    resp = httpx.post(url + "/completion", json=body, timeout=timeout)
    wall = time.perf_counter() - start
    if resp.status_code != 200:
        return {"status": resp.status_code, "error": resp.text[:300], "wall_s": wall}
    data = resp.json()
    t = data.get("timings", {})
    return {"status": 200, "tokens": data.get("tokens_predicted"), "wall_s": wall,
            "decode_tok_s": t.get("predicted_per_second"), "stop_type": data.get("stop_type"),
            "truncated": data.get("truncated")}


def part_llamacpp(engines: Engines, args) -> dict:
    from heron.bench import launch, llama_peer
    from heron.loader.gguf_loader import find_default_gguf

    gguf, ctx, n = find_default_gguf(), args.llama_ctx, args.llama_tokens
    out = {"ctx_size": ctx, "n_predict": n, "n_keep": SINKS, "gguf": str(gguf), "rows": []}
    engines.close()
    llm = engines.get("smollm2", quantization=None, max_model_len=n + 256,
                      streaming_kv=stream_spec(ctx - SINKS))
    prompt = text_ids(llm, "smollm2", args.llama_prompt)
    r = run_one(llm, prompt, greedy(n))
    out["rows"].append({"engine": f"heron, {SINKS} sinks + window {ctx - SINKS} (Q4_1 kept)",
                        "tokens": r["tokens"], "decode_tok_s": r["decode_tok_s"],
                        "completed": r["tokens"] == n})
    engines.close()
    try:
        binary, env = llama_peer.prepare(args.llama_venv,
                                         Path(tempfile.gettempdir()) / "heron-llama-libs")
    except FileNotFoundError as e:
        out["error"] = str(e)
        return out
    out["version"] = llama_peer.version(binary, env)
    for shift in ("--context-shift", "--no-context-shift"):
        port, logf = launch.free_port(), Path(tempfile.mkdtemp()) / "llama_server.log"
        cmd = llama_peer.server_command(binary, gguf, port, args.threads or 2, 1, ctx,
                                        [shift, "--keep", str(SINKS)])
        log(f"llamacpp: {shift}, ctx {ctx}, {n} tokens")
        row = {"engine": f"llama-server -c {ctx} {shift} --keep {SINKS}", "command":
               shlex.join(cmd)}
        with open(logf, "w") as f:
            try:
                proc = launch.start_command(cmd, f"http://127.0.0.1:{port}", "llama-server",
                                            300, group=True, stdout=f, stderr=subprocess.STDOUT,
                                            env=env)
            except (RuntimeError, TimeoutError) as e:
                out["rows"].append(row | {"error": f"{e}: {logf.read_text()[-500:]}"})
                continue
            try:
                row |= _llama_generate(f"http://127.0.0.1:{port}", prompt, n, 900)
            finally:
                launch.stop(proc, group=True)
        row["completed"] = row.get("tokens") == n
        text = logf.read_text().splitlines()
        row["context_shifts"] = sum("context shift," in line for line in text)
        row["log_tail"] = [line for line in text if "shift" in line.lower()
                           or "context" in line.lower() or "release" in line][-4:]
        out["rows"].append(row)
    return out


# ---- part 6: context parallelism -------------------------------------------------------
def _rank_totals(llm: LLM) -> list:
    return list(llm.engine.stats().ranks or [])


def part_cp(engines: Engines, args) -> dict:
    """Prefill time of one long prompt at 1, 2, 4 CP ranks, with each rank's time in
    communication (the ring's point-to-point K/V passes and the collectives) over that
    prefill. On this 2-core machine the ranks share the cores: 2 ranks get one core each,
    4 ranks oversubscribe them."""
    rows = []
    for ranks in args.cp_ranks:
        engines.close()
        try:
            llm = engines.get("smollm2", context_parallel_size=ranks,
                              max_model_len=args.cp_len + 16)
            ids = text_ids(llm, "smollm2", args.cp_len)
            run_one(llm, ids[:64], greedy(1))  # warm
            before = _rank_totals(llm)
            r = run_one(llm, ids, greedy(1))
            after = _rank_totals(llm)
            row = {"ranks": ranks, "tokens": args.cp_len, "prefill_s": r["prefill_s"],
                   "tok_s": args.cp_len / r["prefill_s"]}
            if after:
                row["comm_s"] = [round(a.collective_s + a.p2p_s - b.collective_s - b.p2p_s, 3)
                                 for a, b in zip(after, before)]
                row["split_prefill_tokens"] = [a.split_prefill_tokens - b.split_prefill_tokens
                                               for a, b in zip(after, before)]
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - record why, keep the rest of the run
            rows.append({"ranks": ranks, "error": f"{type(e).__name__}: {e}"[:300]})
    engines.close()
    return {"rows": rows, "cores": os.cpu_count()}


# ---- report -----------------------------------------------------------------------------
def tables(record: dict) -> list[tuple[str, list[str], list[list]]]:
    out = []
    if record.get("ppl"):
        for model in dict.fromkeys(r["model"] for r in record["ppl"]):
            rows = sorted((r for r in record["ppl"] if r["model"] == model),
                          key=lambda r: not r["mode"].startswith("plain"))
            edges = sorted({b["start"] for r in rows for b in r["buckets"]})
            step = max(1, len(edges) // 8)
            shown = edges[::step]
            head = ["mode", "tokens", "ppl"] + [f"@{s // 1024}k" for s in shown] + ["tok/s"]
            body = []
            for r in rows:
                by = {b["start"]: b["ppl"] for b in r["buckets"]}
                body.append([r["mode"], r["tokens"], r["ppl"]] + [by.get(s) for s in shown]
                            + [r["tok_s"]])
            out.append((f"Perplexity by position, {MODELS[model]['title']} (bucket "
                        f"{record['config']['bucket']:,} tokens; @Nk = the bucket starting "
                        f"there)", head, body))
    if record.get("memory"):
        head = ["model / mode", "context", "blocks held", "KV MB held", "full-attn KV MB",
                "decode tok/s"]
        body = [[f"{r['model']} / {r['mode']}", r["context"], r["blocks_held"],
                 r["kv_mb_held"], r["full_kv_mb"], r["decode_tok_s"]]
                for r in record["memory"]]
        out.append(("KV held and decode speed vs context (batch 1)", head, body))
    if record.get("recompute"):
        head = ["cache W", "recompute ms/token", "StreamingLLM ms/token", "speedup",
                "full KV ms/token"]
        body = [[r["window"], r["recompute_ms_per_token"], r["streaming_ms_per_token"],
                 f"{r['speedup']:.1f}x", r["full_kv_ms_per_token"]]
                for r in record["recompute"]]
        out.append(("StreamingLLM vs sliding window with recomputation (SmolLM2)", head,
                    body))
    if record.get("budget"):
        head = ["model / mode", "pool MB", "blocks", "longest accepted"] + [
            f"{m * record['config']['budget_tokens']:,}"
            for m in record["config"]["budget_multiples"]]
        body = []
        for r in record["budget"]:
            if "error" in r:
                body.append([f"{r['model']} / {r['mode']}", "-", "-", r["error"][:60]]
                            + ["-"] * len(r.get("runs") or record["config"]["budget_multiples"]))
                continue
            cells = []
            for run in r["runs"]:
                if run.get("completed"):
                    cells.append(f"ok {run['wall_s']:.0f}s, {run['peak_blocks']} blk")
                else:
                    cells.append("refused" if "refused" in run else "FAILED")
            accepted = (f"{r['max_model_len']:,}" if r["bounded_by_pool"]
                        else f">= {r['max_model_len']:,} (not pool-bound)")
            body.append([f"{r['model']} / {r['mode']}", r["pool_mb"], r["num_kv_blocks"],
                         accepted] + cells)
        out.append((f"Fixed KV budget: the KV of {record['config']['budget_tokens']:,} "
                    f"tokens with every layer full (chunk {record['config']['chunk']})",
                    head, body))
    lc = record.get("llamacpp") or {}
    if lc.get("rows"):
        head = ["engine", "tokens", "decode tok/s", f"past ctx {lc['ctx_size']}?"]
        body = [[r["engine"], r.get("tokens"), r.get("decode_tok_s"),
                 "kept going" if r.get("completed") else
                 f"stopped ({r.get('stop_type') or r.get('error', '?')[:40]})"]
                for r in lc["rows"]]
        out.append((f"Generating {lc['n_predict']:,} tokens past a {lc['ctx_size']}-token "
                    f"context", head, body))
    cp = record.get("cp") or {}
    if cp.get("rows"):
        out.append((f"Context-parallel prefill on {cp.get('cores')} cores",
                    ["ranks", "tokens", "prefill s", "tok/s", "comm s per rank",
                     "prompt tokens per rank"],
                    [[r["ranks"], r.get("tokens"), r.get("prefill_s"), r.get("tok_s"),
                      r.get("comm_s", r.get("error")), r.get("split_prefill_tokens")]
                     for r in cp["rows"]]))
    return out


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [f"# Long context ({machine_summary(m)})", "",
             f"Run: `{record['command']}`, {record['wall_s'] / 60:.1f} min; load average "
             f"(1 min) at the start of each part: "
             + ", ".join(f"{k} {v}" for k, v in record["load_by_part"].items()), ""]
    for title, head, body in tables(record):
        lines += [f"## {title}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in body]
        lines.append("")
    for key, err in (record.get("errors") or {}).items():
        lines += [f"**{key} failed**: `{err}`", ""]
    lines += ["Plots: " + ", ".join(f"`{Path(p).name}`" for p in record.get("plots", [])), ""]
    return "\n".join(lines)


def plots(record: dict, out_dir: Path) -> list[str]:
    from heron.bench.plots import DPI, _pyplot

    plt, paths = _pyplot(), []
    for model in dict.fromkeys(r["model"] for r in record.get("ppl") or []):
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for i, r in enumerate(x for x in record["ppl"] if x["model"] == model):
            xs = [(b["start"] + min(b["end"], r["tokens"])) / 2 for b in r["buckets"]]
            ax.plot(xs, [b["ppl"] for b in r["buckets"]], "-o", ms=3, color=f"C{i}",
                    label=r["mode"])
        ax.axvline(MODELS[model]["native"], color="grey", ls=":", label="trained length")
        ax.set_yscale("log")
        ax.set_xlabel("position (tokens)")
        ax.set_ylabel(f"perplexity per {record['config']['bucket']}-token bucket")
        ax.set_title(MODELS[model]["title"], fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"long_context_ppl_{model}.png"
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(str(path))
    if record.get("memory"):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        series = list(dict.fromkeys((r["model"], r["mode"]) for r in record["memory"]))
        for i, (model, mode) in enumerate(series):
            rows = [r for r in record["memory"] if (r["model"], r["mode"]) == (model, mode)]
            xs = [r["context"] for r in rows]
            axes[0].plot(xs, [r["kv_mb_held"] for r in rows], "-o", ms=3, color=f"C{i}",
                         label=f"{model}: {mode}")
            axes[1].plot(xs, [r["decode_tok_s"] for r in rows], "-o", ms=3, color=f"C{i}",
                         label=f"{model}: {mode}")
        axes[0].set_ylabel("KV held (MB)")
        axes[1].set_ylabel("decode tokens/s (batch 1)")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=6)
        fig.tight_layout()
        path = out_dir / "long_context_memory.png"
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(str(path))
    return paths


# ---- main ---------------------------------------------------------------------------------
def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"subset of {','.join(PARTS)} (cp only when named)")
    p.add_argument("--models", default="smollm2,gemma3", help="subset of smollm2,gemma3")
    p.add_argument("--quantization", default="none",
                   help="weights: 'none' dequantizes the GGUF to float32; '' keeps it quantized")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--ppl-len", type=int, default=12288,
                   help="SmolLM2 tokens for the full-attention modes (plain, dynamic, YaRN)")
    p.add_argument("--stream-len", type=int, default=16384,
                   help="SmolLM2 tokens for the StreamingLLM modes")
    p.add_argument("--gemma-ppl-len", type=int, default=8192)
    p.add_argument("--gemma-stream-len", type=int, default=8192)
    p.add_argument("--stream-window", type=int, default=1024,
                   help="StreamingLLM cache in the ppl part: sinks + window (or window alone)")
    p.add_argument("--bucket", type=int, default=2048, help="perplexity bucket (tokens)")
    p.add_argument("--contexts", default="1024,2048,4096,8192",
                   help="memory part: context lengths")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--window", type=int, default=512,
                   help="memory and budget parts: sliding window / sinks + window")
    p.add_argument("--chunk", type=int, default=256,
                   help="max_num_batched_tokens of the sliding and budget engines (a sliding "
                        "group holds window + chunk)")
    p.add_argument("--recompute-windows", default="256,512,1024,2048")
    p.add_argument("--recompute-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-tokens", type=int, default=1024)
    p.add_argument("--budget-multiples", default="1,4,8")
    p.add_argument("--llama-ctx", type=int, default=512)
    p.add_argument("--llama-tokens", type=int, default=2048)
    p.add_argument("--llama-prompt", type=int, default=64)
    p.add_argument("--llama-venv", type=Path, default=Path(".venv/peers/llama"))
    p.add_argument("--cp-ranks", default="1,2,4")
    p.add_argument("--cp-len", type=int, default=8192)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="only rebuild the tables, markdown and plots from a results file")
    args = p.parse_args(argv)
    if args.quick:
        args.ppl_len, args.stream_len = 10240, 12288
        args.gemma_ppl_len = args.gemma_stream_len = 4096
        args.contexts, args.recompute_windows = "512,2048", "256,1024"
        args.budget_tokens, args.budget_multiples = 1024, "1,4"
        args.llama_tokens, args.reps, args.decode_tokens, args.cp_len = 768, 2, 16, 2048
        args.bucket = 1024
    args.parts = [x for x in args.parts.split(",") if x]
    args.models = [x for x in args.models.split(",") if x]
    for bad in set(args.parts) - set(PARTS):
        p.error(f"unknown part {bad!r}")
    for bad in set(args.models) - set(MODELS):
        p.error(f"unknown model {bad!r}")
    args.quantization = args.quantization or None
    args.contexts = ints(args.contexts)
    args.recompute_windows = ints(args.recompute_windows)
    args.budget_multiples = ints(args.budget_multiples)
    args.cp_ranks = ints(args.cp_ranks)
    # StreamingLLM's attention (torch) costs window + chunk per token: a small chunk halves it
    args.ppl_chunk = {"smollm2": 512, "gemma3": 512}
    return args


def render(path: Path, out_dir: Path) -> int:
    """Tables, markdown and plots again from a saved record (no measuring)."""
    record = json.loads(path.read_text())
    record["plots"] = plots(record, out_dir)
    for title, head, body in tables(record):
        print(f"\n{title}\n{format_table(head, body)}")
    (out_dir / "long_context.md").write_text(markdown(record))
    print(json.dumps(summary(record), separators=(",", ":")))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args.render, args.out_dir)
    machine = machine_info()  # before the run: the load average shows others' work
    engines, start = Engines(args), time.perf_counter()
    record = {"kind": "long_context", "machine": machine,
              "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "load_by_part": {}, "part_s": {}}
    # per model (engines shared between parts stay loaded), then the SmolLM2-only parts
    per_model = {"ppl": part_ppl, "memory": part_memory, "budget": part_budget}
    steps = [(part, model) for model in args.models for part in per_model]
    steps += [(part, None) for part in ("recompute", "llamacpp", "cp")]
    for part, model in steps:
        if part not in args.parts:
            continue
        key = f"{part}/{model}" if model else part
        record["load_by_part"][key] = round(os.getloadavg()[0], 2)
        t0 = time.perf_counter()
        try:
            if model:
                record.setdefault(part, []).extend(per_model[part](engines, args, model))
            else:
                record[part] = globals()[f"part_{part}"](engines, args)
        except Exception as e:  # noqa: BLE001 - record it, run the other parts
            log(f"part {key} FAILED: {type(e).__name__}: {e}")
            record.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"[:500]
            engines.close()
        record["part_s"][key] = round(time.perf_counter() - t0, 1)
        log(f"part {key} done in {record['part_s'][key]:.0f} s")
    engines.close()
    record["wall_s"] = time.perf_counter() - start
    record["engine_loads_s"] = engines.load_s
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_json = args.out_dir / "long_context.json"
    out_json.write_text(json.dumps(record, indent=1) + "\n")  # first: the figures are safe
    record["plots"] = plots(record, args.out_dir)
    out_json.write_text(json.dumps(record, indent=1) + "\n")
    for title, head, body in tables(record):
        print(f"\n{title}\n{format_table(head, body)}")
    (args.out_dir / "long_context.md").write_text(markdown(record))
    print(json.dumps(summary(record), separators=(",", ":")))
    print(f"figures: {args.out_dir}/long_context.json, long_context.md, "
          + ", ".join(Path(p).name for p in record["plots"]))
    return 0


def summary(record: dict) -> dict:
    """The headline numbers, for the one JSON line."""
    out = {"kind": "long_context", "wall_s": round(record["wall_s"], 1),
           "load_by_part": record["load_by_part"]}
    if record.get("ppl"):
        out["ppl"] = {f"{r['model']}/{r['mode']}": round(r["ppl"], 2) for r in record["ppl"]}
    if record.get("recompute"):
        out["recompute_speedup"] = {r["window"]: round(r["speedup"], 1)
                                    for r in record["recompute"]}
    if record.get("budget"):
        out["budget_longest_completed"] = {
            f"{r['model']}/{r['mode']}": max([x["length"] for x in r.get("runs", [])
                                              if x.get("completed")], default=0)
            for r in record["budget"]}
    if (record.get("llamacpp") or {}).get("rows"):
        out["past_ctx"] = {r["engine"]: [r.get("tokens"), r.get("decode_tok_s")]
                           for r in record["llamacpp"]["rows"]}
    return out


if __name__ == "__main__":
    sys.exit(main())
