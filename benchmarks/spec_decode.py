"""Speculative decoding on vs off in one run: the same prompts, greedy, on SmolLM2-135M.

    .venv/bin/python benchmarks/spec_decode.py --quick          # smoke run (a few minutes)
    .venv/bin/python benchmarks/spec_decode.py                  # everything (25-35 min)
    .venv/bin/python benchmarks/spec_decode.py --rows copy,vllm --num-prompts 2

Row groups (``--rows``, comma-separated):
  copy   batch 1: "here is a Python file from this repo, rewrite it with one function
         renamed, changing nothing else" (real small heron sources); off vs ngram
  chat   batch 1: ordinary chat questions; off vs ``--chat-methods`` (ngram, layer_skip
         with 8 and 15 of SmolLM2's 30 layers, a separate draft model, an EAGLE head)
  batch  throughput at ``--batch-sizes`` on copy-heavy prompts (``--chunk-lines``-line
         chunks of repo files): off vs ngram vs ngram with ``disable_by_batch_size`` (the
         policy that turns speculation off for big batches); the crossover is where on/off
         drops under 1. Besides end-to-end tok/s, decode-only tok/s: the batch's prefill
         time (the same batch with one output token, on off) taken off
  vllm   vLLM's CPU build on the copy and chat prompts at batch 1, without speculation and
         with its own ngram speculation (same keys as heron's), in vLLM's venv

Every configuration of a group is alive at once and the prompts run round robin (prompt 1
on every configuration, then prompt 2, ...), so drifting machine speed hits all of them
alike; only same-run ratios mean anything. Prompts are token ids from heron's tokenizer
with the chat template applied; both engines get the same ids. Requests are greedy and stop
at EOS or ``--max-tokens``; greedy speculation is lossless, so every "on" configuration
should reproduce the "off" outputs token for token (the ``same as off`` column).

Acceptance figures come from ``llm.engine.stats().spec_decode`` (differences around each
timed call): acceptance rate = accepted / drafted tokens; mean acceptance length = tokens a
verifying step yields per sequence (accepted + the bonus token); per position = share of
drafts whose i-th token was accepted. vLLM's come from its ``vllm:spec_decode_*`` counters.

The ``draft`` method needs a draft model directory (``--draft-model``); without one the
benchmark writes the first ``--draft-layers`` layers of SmolLM2 (from the embedded GGUF,
via transformers) as an HF Llama directory once. ``eagle`` needs a head trained by
``heron train-draft`` (``--eagle-head``, default /tmp/eagle-smollm2); absent, its row is
skipped with a note.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import select
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# small real sources of this repo: prompt + rewritten file fit in ~1.5k tokens
COPY_FILES = ["heron/speculative/ngram.py", "heron/speculative/stats.py", "heron/bench/table.py",
              "heron/spec/train_config.py", "heron/bench/machine.py", "heron/bench/arrivals.py",
              "heron/bench/results.py", "heron/bench/server_metrics.py"]
# longer sources cut into 40-line chunks for the batch rows (distinct prompts)
CHUNK_SOURCES = ["heron/bench", "heron/speculative", "heron/engine", "heron/worker"]
CHAT_QUESTIONS = [
    "Why is the sky blue? Explain it simply.",
    "Give me five tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Explain what a hash table is and when to use one.",
    "Write a short story about a robot who learns to paint.",
    "How do I make a good cup of tea?",
    "What are the main causes of the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
    "What are some healthy breakfast ideas?",
    "Explain how a bicycle stays upright.",
    "What should I pack for a weekend camping trip?",
    "Describe the water cycle.",
]
DEFAULT_CHAT_METHODS = "ngram,layer_skip:8,layer_skip:15,draft,eagle"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
GOALS = {"copy": 2.5, "chat": 1.8}  # batch-1 on/off speedups asked for


# ---- arguments ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", default=None,
                   help="comma-separated groups: copy, chat, batch, vllm (default: all; "
                        "--quick: copy,chat,batch)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 prompt per workload, 24 tokens, batch sizes 1,8, "
                        "chat methods ngram,layer_skip:8,draft")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts of the copy-heavy workload (default 3, --quick 1)")
    p.add_argument("--chat-prompts", type=int, default=None,
                   help="prompts of the chat workload (default 2, --quick 1; the model-based "
                        "drafts are slow when they miss)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max output tokens per batch-1 request (default 256, --quick 24)")
    p.add_argument("--batch-sizes", default=None, help="batch row sizes (default 1,16,64; "
                   "--quick 1,8)")
    p.add_argument("--batch-max-tokens", type=int, default=None,
                   help="max output tokens per batch-row request (default 64, --quick 16)")
    p.add_argument("--chunk-lines", type=int, default=20,
                   help="lines per source chunk in the batch rows' prompts")
    p.add_argument("--disable-by-batch-size", type=int, default=8,
                   help="the batch rows' policy configuration")
    p.add_argument("--chat-methods", default=None,
                   help=f"chat configurations (default {DEFAULT_CHAT_METHODS}; --quick "
                        f"ngram,layer_skip:8,draft)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-model", type=Path, default=None,
                   help="draft model HF directory (default: build SmolLM2's first "
                        "--draft-layers layers)")
    p.add_argument("--draft-layers", type=int, default=8)
    p.add_argument("--eagle-head", type=Path, default=Path("/tmp/eagle-smollm2"),
                   help="EAGLE head directory (skipped with a note if absent)")
    p.add_argument("--threads", type=int, default=2, help="heron's torch threads")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--hf-dir", type=Path, default=Path("/tmp/smollm2-hf"),
                   help="SmolLM2 as an HF directory for vLLM (exported once if absent)")
    p.add_argument("--vllm-venv", type=Path, default=REPO / ".venv" / "peers" / "vllm")
    p.add_argument("--vllm-timeout", type=float, default=1200.0,
                   help="seconds to wait for vLLM's start-up and for each reply")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                   "spec_decode.json", help="results JSON (the markdown goes next to it, "
                   ".md)")
    args = p.parse_args(argv)
    quick = args.quick
    args.rows = args.rows or ("copy,chat,batch" if quick else "copy,chat,batch,vllm")
    args.num_prompts = args.num_prompts or (1 if quick else 3)
    args.chat_prompts = args.chat_prompts or min(args.num_prompts, 1 if quick else 2)
    args.max_tokens = args.max_tokens or (24 if quick else 256)
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,8" if quick else
                                                                "1,16,64")).split(",")]
    args.batch_max_tokens = args.batch_max_tokens or (16 if quick else 64)
    args.chat_methods = (args.chat_methods or ("ngram,layer_skip:8,draft" if quick else
                                               DEFAULT_CHAT_METHODS)).split(",")
    groups = args.rows.split(",")
    unknown = set(groups) - {"copy", "chat", "batch", "vllm"}
    if unknown:
        raise SystemExit(f"--rows: unknown groups {sorted(unknown)} (copy, chat, batch, vllm)")
    args.groups = groups
    return args


# ---- configurations ----------------------------------------------------------------------
@dataclass
class Conf:
    name: str  # "off", "ngram", "layer_skip:8", "draft", "eagle", "ngram+disable8"
    spec: dict | None
    note: str = ""


def make_conf(name: str, args, draft_dir: Path | None) -> Conf:
    k = args.num_speculative_tokens
    if name == "off":
        return Conf(name, None)
    if name == "ngram":
        return Conf(name, NGRAM | {"num_speculative_tokens": k})
    if name.startswith("ngram+disable"):
        return Conf(name, NGRAM | {"num_speculative_tokens": k,
                                   "disable_by_batch_size": int(name[len("ngram+disable"):])})
    if name.startswith("layer_skip"):
        layers = int(name.split(":")[1]) if ":" in name else None
        return Conf(name, {"method": "layer_skip", "num_speculative_tokens": k,
                           "num_layers": layers})
    if name == "draft":
        return Conf(name, {"method": "draft", "num_speculative_tokens": k,
                           "model": str(draft_dir)}, f"draft model {draft_dir}")
    if name == "eagle":
        return Conf(name, {"method": "eagle", "num_speculative_tokens": k,
                           "model": str(args.eagle_head)}, f"EAGLE head {args.eagle_head}")
    raise SystemExit(f"unknown configuration {name!r}")


def build_draft_dir(num_layers: int, out: Path) -> Path:
    """The first ``num_layers`` layers of the embedded SmolLM2 (+ embeddings, final norm,
    LM head) as an HF Llama directory: a draft model that shares the tokenizer."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from heron.loader.gguf_loader import find_default_gguf

    gguf = Path(find_default_gguf())
    print(f"building a {num_layers}-layer draft model from {gguf.name} in {out}",
          file=sys.stderr, flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["num_hidden_layers"] = num_layers
    cfg.pop("layer_types", None)  # per-layer lists follow num_hidden_layers
    config = LlamaConfig(**cfg)
    fresh = LlamaForCausalLM(config).to(torch.float32)
    keep = {}
    for key, value in loaded.state_dict().items():
        m = re.match(r"model\.layers\.(\d+)\.", key)
        if m is None or int(m.group(1)) < num_layers:
            keep[key] = value
    missing, unexpected = fresh.load_state_dict(keep, strict=False)
    missing = [m for m in missing if m != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"draft weights: missing {missing}, unexpected {unexpected}")
    tmp = out.with_name(out.name + ".partial")
    fresh.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    if loaded.generation_config is not None:
        loaded.generation_config.save_pretrained(tmp)
    tmp.rename(out)
    del loaded, fresh
    gc.collect()
    return out


# ---- prompts -----------------------------------------------------------------------------
def _rename_target(source: str) -> str | None:
    names = re.findall(r"^\s*def ([a-zA-Z_]\w*)\(", source, re.M)
    names = [n for n in names if not n.startswith("__")] or \
        re.findall(r"^class ([A-Za-z_]\w*)", source, re.M)
    return names[0] if names else None


def copy_message(source: str, name: str, what: str = "Python file") -> list[dict]:
    new = (name + "_v2") if name[0].islower() else (name + "V2")
    return [{"role": "user", "content": (
        f"Here is a {what}:\n```python\n{source.rstrip()}\n```\n"
        f"Rewrite it with `{name}` renamed to `{new}`, changing nothing else. Reply with the "
        f"whole code in one code block.")}]


def copy_prompts(llm, n: int) -> list[dict]:
    out = []
    for rel in COPY_FILES:
        path = REPO / rel
        if not path.exists():
            continue
        source = path.read_text()
        name = _rename_target(source)
        if name is None:
            continue
        out.append({"label": rel, "ids": llm.apply_chat_template(copy_message(source, name))})
        if len(out) == n:
            break
    if len(out) < n:
        print(f"note: only {len(out)} copy-heavy files found", file=sys.stderr)
    return out


def chat_prompts(llm, n: int) -> list[dict]:
    qs = (CHAT_QUESTIONS * (n // len(CHAT_QUESTIONS) + 1))[:n]
    return [{"label": q, "ids": llm.apply_chat_template([{"role": "user", "content": q}])}
            for q in qs]


def chunk_prompts(llm, n: int, max_prompt: int = 520, lines: int = 40) -> list[dict]:
    """``n`` distinct copy-heavy prompts: ``lines``-line chunks (with a def) of repo sources
    (shorter ones if there are not enough)."""
    out, seen = [], set()
    files = sorted(p for d in CHUNK_SOURCES for p in (REPO / d).glob("*.py"))
    for lines_per in sorted({lines, max(8, lines * 2 // 3), max(8, lines // 2)}, reverse=True):
        for path in files:
            lines = path.read_text().splitlines()
            for start in range(0, max(1, len(lines) - 8), lines_per):
                chunk = "\n".join(lines[start:start + lines_per])
                name = _rename_target(chunk)
                if name is None or chunk in seen:
                    continue
                ids = llm.apply_chat_template(copy_message(chunk, name, "piece of Python code"))
                if len(ids) > max_prompt:
                    continue
                seen.add(chunk)
                out.append({"label": f"{path.relative_to(REPO)}:{start + 1}", "ids": ids})
                if len(out) == n:
                    return out
    raise RuntimeError(f"only {len(out)} chunk prompts for a batch of {n}")


# ---- heron -------------------------------------------------------------------------------
def spec_snapshot(llm) -> dict | None:
    counts = llm.engine.stats().spec_decode
    return asdict(counts) if counts is not None else None


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    pos_a, pos_b = after["accepted_per_pos"], before["accepted_per_pos"]
    pos_b = pos_b + [0] * (len(pos_a) - len(pos_b))
    return {"num_drafts": after["num_drafts"] - before["num_drafts"],
            "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "num_accepted_tokens": after["num_accepted_tokens"] - before["num_accepted_tokens"],
            "accepted_per_pos": [a - b for a, b in zip(pos_a, pos_b)]}


def add_spec(a: dict | None, b: dict | None) -> dict | None:
    if a is None:
        return b
    if b is None:
        return a
    n = max(len(a["accepted_per_pos"]), len(b["accepted_per_pos"]))
    pa = a["accepted_per_pos"] + [0] * (n - len(a["accepted_per_pos"]))
    pb = b["accepted_per_pos"] + [0] * (n - len(b["accepted_per_pos"]))
    return {k: a[k] + b[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} \
        | {"accepted_per_pos": [x + y for x, y in zip(pa, pb)]}


def spec_figures(s: dict | None) -> dict:
    if not s:
        return {}
    drafts, drafted, accepted = s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "accepted_per_pos_rate": [a / drafts for a in s["accepted_per_pos"]]
            if drafts else []}


def make_heron(conf: Conf, args, kv_blocks: int, max_seqs: int):
    from heron import LLM

    return LLM(None, max_model_len=args.max_model_len, num_threads=args.threads,
               num_kv_blocks=kv_blocks, max_num_seqs=max_seqs, seed=0,
               speculative_config=conf.spec)


MAX_CHUNK_PROMPT = 520  # tokens: the batch rows' prompts are at most this long


def capacity(args, conf_name: str) -> tuple[int, int]:
    """(KV blocks, max running sequences) for a configuration: room for one request of the
    full context, and for the batch rows' largest batch if it runs them."""
    blocks, seqs = -(-args.max_model_len // 16) + 2, 8
    if "batch" in args.groups and (conf_name == "off" or conf_name.startswith("ngram")):
        per = -(-(MAX_CHUNK_PROMPT + args.batch_max_tokens + args.num_speculative_tokens + 2)
                // 16) + 1
        blocks, seqs = max(blocks, per * max(args.batch_sizes)), max(seqs, max(args.batch_sizes))
    return blocks + 16, seqs


class Pool:
    """heron engines by configuration name, built once and shared by the row groups."""

    def __init__(self, args) -> None:
        self.args, self.engines, self.errors, self.build_s = args, {}, {}, {}

    def ensure(self, confs: list[Conf]) -> None:
        for conf in confs:
            if conf.name in self.engines or conf.name in self.errors:
                continue
            blocks, seqs = capacity(self.args, conf.name)
            print(f"  building heron {conf.name} ({blocks} KV blocks, {seqs} seqs)",
                  file=sys.stderr, flush=True)
            t = time.perf_counter()
            try:
                self.engines[conf.name] = make_heron(conf, self.args, blocks, seqs)
            except Exception:  # noqa: BLE001 - recorded in the report, the run goes on
                self.errors[conf.name] = traceback.format_exc()
                print(self.errors[conf.name], file=sys.stderr)
                continue
            self.build_s[conf.name] = time.perf_counter() - t
            print(f"    ready in {self.build_s[conf.name]:.1f} s", file=sys.stderr, flush=True)
            self.generate(conf.name, [self.args.warm], 16)  # warmup, untimed

    def generate(self, name: str, prompts: list[list[int]], max_tokens: int) -> dict | None:
        """One timed ``generate`` on configuration ``name`` (prefix cache emptied first);
        None (and the engine dropped, its traceback kept) if it raises."""
        from heron import SamplingParams

        llm = self.engines.get(name)
        if llm is None:
            return None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        try:
            llm.reset_prefix_cache()
            before = spec_snapshot(llm)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            after = spec_snapshot(llm)
        except Exception:  # noqa: BLE001
            self.errors[name] = traceback.format_exc()
            print(f"heron {name} failed:\n{self.errors[name]}", file=sys.stderr)
            self.close([name])
            return None
        ids = [list(o.outputs[0].token_ids) for o in outs]
        return {"elapsed_s": elapsed, "output_ids": ids, "spec": spec_delta(before, after)}

    def close(self, names=None) -> None:
        for n in list(self.engines) if names is None else names:
            llm = self.engines.pop(n, None)
            if llm is not None:
                try:
                    llm.engine.shutdown()
                except Exception:  # noqa: BLE001
                    pass
        gc.collect()


def summarise(runs: list[dict], prompts: list[list[int]]) -> dict:
    """One configuration's figures over its timed calls."""
    elapsed = sum(r["elapsed_s"] for r in runs)
    outputs = [ids for r in runs for ids in r["output_ids"]]
    spec = None
    for r in runs:
        spec = add_spec(spec, r["spec"])
    n_out = sum(len(o) for o in outputs)
    return {"num_requests": len(outputs), "input_tokens": sum(len(p) for p in prompts),
            "output_tokens": n_out, "elapsed_s": elapsed,
            "output_tok_s": n_out / elapsed if elapsed else None,
            "spec": spec, **spec_figures(spec), "outputs": outputs,
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def compare_outputs(outputs: list[list[int]], ref: list[list[int]]) -> dict:
    """Greedy losslessness: how many outputs equal the reference's, and where the first
    differing one diverges."""
    same = [a == b for a, b in zip(outputs, ref)]
    diverge = []
    for i, (a, b) in enumerate(zip(outputs, ref)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diverge.append({"request": i, "position": pos, "len": len(a), "ref_len": len(b)})
    return {"identical": sum(same), "of": len(same), "divergences": diverge}


def run_batch1(name: str, pool: Pool, confs: list[Conf], args, prompts: list[dict],
               skipped: dict) -> dict:
    """Batch 1: every prompt alone, round robin over the configurations."""
    print(f"group {name}: {len(prompts)} prompts x {[c.name for c in confs]}", file=sys.stderr,
          flush=True)
    pool.ensure(confs)
    runs = {c.name: [] for c in confs}
    for i, p in enumerate(prompts):
        for conf in confs:
            r = pool.generate(conf.name, [p["ids"]], args.max_tokens)
            if r is not None:
                runs[conf.name].append(r)
                print(f"  {name} prompt {i + 1}/{len(prompts)} {conf.name}: "
                      f"{len(r['output_ids'][0])} tok in {r['elapsed_s']:.1f} s",
                      file=sys.stderr, flush=True)
    ids = [p["ids"] for p in prompts]
    results = {}
    for conf in confs:
        if conf.name in pool.errors:
            results[conf.name] = {"error": pool.errors[conf.name]}
        elif len(runs[conf.name]) == len(prompts):
            results[conf.name] = summarise(runs[conf.name], ids) | {"note": conf.note}
    for n, why in skipped.items():
        results[n] = {"skipped": why}
    return finish(results, batch=1)


def finish(results: dict, batch: int) -> dict:
    off = results.get("off", {})
    for n, r in results.items():
        if "output_tok_s" not in r:
            continue
        r["batch"] = batch
        if off.get("output_tok_s") and n != "off":
            r["vs_off"] = r["output_tok_s"] / off["output_tok_s"]
            r["same_as_off"] = compare_outputs(r["outputs"], off["outputs"])
    return results


def run_batch_rows(args, pool: Pool, prompts: list[dict], confs: list[Conf]) -> dict:
    sizes = sorted(args.batch_sizes)
    print(f"group batch: sizes {sizes} x {[c.name for c in confs]}", file=sys.stderr, flush=True)
    pool.ensure(confs)
    out = {}
    for b in sizes:
        batch = [p["ids"] for p in prompts[:b]]
        runs = {}
        for conf in confs:
            r = pool.generate(conf.name, batch, args.batch_max_tokens)
            if r is not None:
                runs[conf.name] = summarise([r], batch) | {"note": conf.note}
                print(f"  batch {b} {conf.name}: {runs[conf.name]['output_tokens']} tok "
                      f"in {r['elapsed_s']:.1f} s", file=sys.stderr, flush=True)
            elif conf.name in pool.errors:
                runs[conf.name] = {"error": pool.errors[conf.name]}
        # the prefill's share: the same batch for one output token each, on "off"
        probe = pool.generate("off", batch, 1)
        if probe is not None:
            for r in runs.values():
                dec_s = r.get("elapsed_s", 0) - probe["elapsed_s"]
                if "output_tokens" in r and dec_s > 0:
                    r["prefill_s"] = probe["elapsed_s"]
                    r["decode_tok_s"] = (r["output_tokens"] - b) / dec_s
        out[b] = finish(runs, batch=b)
        off_dec = runs.get("off", {}).get("decode_tok_s")
        for r in runs.values():
            if off_dec and r.get("decode_tok_s"):
                r["decode_vs_off"] = r["decode_tok_s"] / off_dec
    return out


# ---- vLLM --------------------------------------------------------------------------------
VLLM_WORKER = r'''
"""vLLM's offline LLM for benchmarks/spec_decode.py (runs in vLLM's venv; stdlib + vllm).
argv: model_dir max_model_len max_num_seqs max_num_batched_tokens spec_json|none reply_fd.
stdin: {"prompts": [[ids]], "max_tokens": n} lines; replies on reply_fd: {"outputs",
"elapsed_s", "spec"} (spec: cumulative vllm:spec_decode_* counters)."""
import json, os, sys, time, traceback


def spec_counters(llm):
    out = {}
    try:
        metrics = llm.get_metrics()
    except Exception:
        return None
    for m in metrics:
        if not m.name.startswith("vllm:spec_decode"):
            continue
        key = m.name[len("vllm:spec_decode_"):]
        if hasattr(m, "values"):
            prev = out.get(key, [])
            vals = list(m.values)
            out[key] = [a + b for a, b in zip(vals + [0] * (len(prev) - len(vals)),
                                              prev + [0] * (len(vals) - len(prev)))]
        elif hasattr(m, "value"):
            out[key] = out.get(key, 0) + m.value
    return out


def main():
    model, max_len, max_seqs, step_tokens, spec, reply_fd = sys.argv[1:7]
    replies = os.fdopen(int(reply_fd), "w")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model, dtype="float32", max_model_len=int(max_len),
                  max_num_seqs=int(max_seqs), max_num_batched_tokens=int(step_tokens),
                  gpu_memory_utilization=0.4, seed=0, disable_log_stats=False,
                  speculative_config=None if spec == "none" else json.loads(spec))
    except Exception:
        replies.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        replies.flush()
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
            params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            reply = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                     "elapsed_s": elapsed, "spec": spec_counters(llm)}
        except Exception:
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
'''


class VLLMWorker:
    def __init__(self, python: Path, model_dir: Path, spec: dict | None, args,
                 log_path: Path) -> None:
        script = Path(tempfile.gettempdir()) / "heron_spec_decode_vllm_worker.py"
        script.write_text(VLLM_WORKER)
        self.timeout = args.vllm_timeout
        read_fd, write_fd = os.pipe()
        env = os.environ.copy()
        env.setdefault("VLLM_CACHE_ROOT", str(Path(tempfile.gettempdir()) / "vllm-cache"))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        cmd = [str(python), str(script), str(model_dir), str(args.max_model_len), "8", "2048",
               json.dumps(spec) if spec else "none", str(write_fd)]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self.log,
                                     stderr=subprocess.STDOUT, pass_fds=(write_fd,), text=True,
                                     env=env)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        ready = self._reply()
        if not ready.get("ready"):
            raise RuntimeError(ready.get("error", "the vLLM worker did not start"))

    def _reply(self) -> dict:
        if not select.select([self.replies], [], [], self.timeout)[0]:
            self.proc.kill()
            raise TimeoutError(f"the vLLM worker did not answer within {self.timeout:.0f} s")
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited (status {self.proc.wait()})")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.replies.close()
        self.log.close()


def vllm_spec_delta(before: dict | None, after: dict | None) -> dict | None:
    if not after or "num_drafts" not in after:
        return None
    before = before or {}
    pos_a = after.get("num_accepted_tokens_per_pos", [])
    pos_b = before.get("num_accepted_tokens_per_pos", []) or [0] * len(pos_a)
    pos_b = pos_b + [0] * (len(pos_a) - len(pos_b))
    return {"num_drafts": int(after["num_drafts"] - before.get("num_drafts", 0)),
            "num_draft_tokens": int(after["num_draft_tokens"] -
                                    before.get("num_draft_tokens", 0)),
            "num_accepted_tokens": int(after["num_accepted_tokens"] -
                                       before.get("num_accepted_tokens", 0)),
            "accepted_per_pos": [int(a - b) for a, b in zip(pos_a, pos_b)]}


def run_vllm(args, workloads: dict[str, list[dict]], warm: list[int], workdir: Path) -> dict:
    """vLLM off, then vLLM ngram (one engine at a time), each on every workload's prompts
    one by one; {"workload": {"off": rec, "ngram": rec}} plus errors."""
    from heron.bench.vllm_peer import ensure_venv, export_hf_dir

    python = ensure_venv(args.vllm_venv)
    if not (args.hf_dir / "config.json").exists():
        from heron.loader.gguf_loader import find_default_gguf

        export_hf_dir(Path(find_default_gguf()), args.hf_dir)
    confs = {"off": None, "ngram": NGRAM | {"num_speculative_tokens":
                                            args.num_speculative_tokens}}
    out = {w: {} for w in workloads}
    for name, spec in confs.items():
        log = workdir / f"vllm_{name}.log"
        print(f"group vllm: starting vLLM {name} (log {log}; start-up compiles, minutes)",
              file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            worker = VLLMWorker(python, args.hf_dir, spec, args, log)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            err = f"{type(exc).__name__}: {exc}\n--- log tail ---\n" + \
                (log.read_text()[-4000:] if log.exists() else "")
            print(f"vLLM {name} did not start:\n{err}", file=sys.stderr)
            for w in workloads:
                out[w][name] = {"error": err}
            continue
        startup = time.perf_counter() - t
        print(f"    ready in {startup:.0f} s", file=sys.stderr, flush=True)
        try:
            before = worker.generate([warm], 16)["spec"]  # cumulative counters
            for w, prompts in workloads.items():
                runs = []
                for i, p in enumerate(prompts):
                    r = worker.generate([p["ids"]], args.max_tokens)
                    runs.append({"elapsed_s": r["elapsed_s"], "output_ids": r["outputs"],
                                 "spec": vllm_spec_delta(before, r["spec"])})
                    before = r["spec"]
                    print(f"  vllm {w} prompt {i + 1}/{len(prompts)} {name}: "
                          f"{len(r['outputs'][0])} tok in {r['elapsed_s']:.1f} s",
                          file=sys.stderr, flush=True)
                ids = [p["ids"] for p in prompts]
                out[w][name] = summarise(runs, ids) | {"startup_s": startup}
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"
            print(f"vLLM {name} failed: {err}", file=sys.stderr)
            for w in workloads:
                out[w].setdefault(name, {"error": err})
        finally:
            worker.close()
    threads = re.findall(r"core ids=(\[[^\]]*\])", (workdir / "vllm_off.log").read_text()) \
        if (workdir / "vllm_off.log").exists() else []
    return {w: finish(r, batch=1) for w, r in out.items()} | {
        "_cores": threads[-1] if threads else None}


# ---- report ------------------------------------------------------------------------------
def _f(x, digits=2, suffix=""):
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}{suffix}"


def table_rows(section: str, results: dict, engine: str, batch: int | None = None,
               decode: bool = False) -> list:
    rows = []
    for name, r in results.items():
        if name.startswith("_"):
            continue
        b = batch if batch is not None else r.get("batch", 1)
        if "error" in r or "skipped" in r:
            why = r.get("skipped") or ("ERROR: " + r["error"].strip().splitlines()[-1])
            rows.append([section, b, engine, name, "-", "-", "-", "-", "-", "-", "-",
                         why[:120]] + (["-", "-"] if decode else []))
            continue
        pos = " / ".join(f"{x:.2f}" for x in r.get("accepted_per_pos_rate") or []) or "-"
        spec = r.get("spec")
        no_drafts = spec is not None and spec["num_drafts"] == 0
        same = r.get("same_as_off")
        same = f"{same['identical']}/{same['of']}" if same else "-"
        rows.append([section, b, engine, name, _f(r["output_tokens"]), _f(r["elapsed_s"], 1),
                     _f(r["output_tok_s"]),
                     _f(r.get("vs_off"), 2, "x") if name != "off" else "1.00x",
                     "no drafts" if no_drafts else _f(r.get("acceptance_rate")),
                     "-" if no_drafts else _f(r.get("mean_acceptance_length")), pos,
                     same] + ([_f(r.get("decode_tok_s")),
                               _f(r.get("decode_vs_off"), 2, "x")] if decode else []))
    return rows


HEADERS = ["workload", "batch", "engine", "config", "out tok", "s", "out tok/s", "vs off",
           "accept rate", "mean acc len", "accepted per pos (1..k)", "same as off"]


def markdown_table(rows: list[list], decode: bool = False) -> str:
    headers = HEADERS + (["decode tok/s", "decode vs off"] if decode else [])
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def crossover(batch: dict, policy: str | None = None, conf: str = "ngram") -> str:
    """Where speculation stops paying as the batch grows (on/off under 1), on decode-only
    rates where measured, with the run's noise: ``policy`` (speculation disabled at those
    batch sizes) does the off configuration's work, so its distance from 1 is noise."""
    key = "decode_vs_off" if all(conf in r and r[conf].get("decode_vs_off")
                                 for r in batch.values()) else "vs_off"
    what = "decode-only" if key == "decode_vs_off" else "end-to-end"
    ratios = [(b, r[conf][key]) for b, r in sorted(batch.items())
              if conf in r and r[conf].get(key)]
    if not ratios:
        return "no data"
    noise = ""
    if policy:
        n = int(policy.rsplit("disable", 1)[1])
        devs = [abs(r[policy][k] - 1) for b, r in batch.items() if b >= n and policy in r
                for k in ("vs_off", "decode_vs_off") if r[policy].get(k)]
        if devs:
            noise = (f" Noise: {policy} does off's work at batch >= {n}, and its ratios there "
                     f"are within {max(devs):.0%} of 1.")
    prev = None
    for b, ratio in ratios:
        if ratio < 1.0:
            return (f"{conf} on/off ({what}) drops below 1 at batch {b} ({ratio:.2f}x)" +
                    (f"; still {prev[1]:.2f}x at batch {prev[0]}: the crossover lies between "
                     f"batch {prev[0]} and {b}." if prev else ": already at the smallest batch.")
                    + noise)
        prev = (b, ratio)
    return (f"{conf} on/off ({what}) stays >= 1 up to batch {ratios[-1][0]} "
            f"({ratios[-1][1]:.2f}x): no crossover in the sizes run." + noise)


def report(args, record: dict) -> str:
    res = record["results"]
    rows = []
    for w in ("copy", "chat"):
        if w in res:
            rows += table_rows(w, res[w], "heron")
        if "vllm" in res and w in res["vllm"]:
            rows += table_rows(w, res["vllm"][w], "vLLM 0.32 CPU")
    batch_rows = []
    for b, r in (res.get("batch") or {}).items():
        batch_rows += table_rows("copy chunks", r, "heron", b, decode=True)
    m = record["machine"]
    out = ["# Speculative decoding: on vs off (SmolLM2-135M-Instruct, greedy)", "",
           f"`{record['command']}`", "",
           f"{m.get('cpu')} ({m.get('cores')} cores), {m.get('date')}; heron {args.threads} "
           f"torch threads; load average (1 min) {m.get('loadavg_1m_at_start')} at start, "
           f"{record['loadavg_1m_at_end']} at end (others' work on a shared machine: only "
           f"same-run ratios count). Wall time {record['wall_s'] / 60:.1f} min.", "",
           f"Batch 1: {args.num_prompts} copy-heavy and {args.chat_prompts} chat prompts, max "
           f"{args.max_tokens} output "
           f"tokens (EOS stops), k = {args.num_speculative_tokens} drafts; configurations run "
           f"round robin per prompt. `vs off` = out tok/s / the same engine's off out tok/s; "
           f"`same as off` = outputs token-identical to the off run.", ""]
    if rows:
        out += ["## Batch 1", "", markdown_table(rows), ""]
    if batch_rows:
        out += [f"## Throughput by batch size ({args.batch_max_tokens} max output tokens, "
                f"distinct {args.chunk_lines}-line chunk prompts; `ngram+disable{args.disable_by_batch_size}` "
                f"= ngram with disable_by_batch_size={args.disable_by_batch_size})", "",
                markdown_table(batch_rows, decode=True), "",
                "`decode tok/s`: (output tokens - batch) / (seconds - the same batch's prefill "
                "seconds, timed on off with 1 output token each).", "",
                "Crossover: " + record["crossover"], ""]
    if record["notes"]:
        out += ["## Notes", ""] + [f"- {n}" for n in record["notes"]] + [""]
    return "\n".join(out)


def goal_notes(res: dict) -> list[str]:
    notes = []
    for w, goal in GOALS.items():
        if w not in res:
            continue
        best = max(((n, r["vs_off"]) for n, r in res[w].items() if r.get("vs_off")),
                   key=lambda x: x[1], default=None)
        if best:
            notes.append(f"{w} batch 1 goal >= {goal}x: best {best[0]} {best[1]:.2f}x "
                         f"({'met' if best[1] >= goal else 'NOT met'})")
    return notes


def correctness_notes(res: dict) -> list[str]:
    notes = []

    def scan(where: str, results: dict):
        for n, r in results.items():
            s = r.get("same_as_off") if isinstance(r, dict) else None
            if s and s["identical"] < s["of"]:
                notes.append(f"{where} {n}: {s['of'] - s['identical']} of {s['of']} outputs "
                             f"differ from off (first divergence per request: "
                             f"{s['divergences']})")
            if isinstance(r, dict) and "error" in r:
                notes.append(f"{where} {n} ERROR:\n\n```\n{r['error'].strip()}\n```")
    for w in ("copy", "chat"):
        if w in res:
            scan(f"heron {w}", res[w])
        if "vllm" in res and w in res["vllm"]:
            scan(f"vLLM {w}", res["vllm"][w])
    for b, r in (res.get("batch") or {}).items():
        scan(f"heron batch {b}", r)
    return notes


def agreement_notes(res: dict) -> list[str]:
    notes = []
    for w in ("copy", "chat"):
        h, v = res.get(w, {}).get("off"), res.get("vllm", {}).get(w, {}).get("off")
        if h and v and "outputs" in h and "outputs" in v:
            c = compare_outputs(v["outputs"], h["outputs"])
            notes.append(f"{w}: vLLM off vs heron off outputs identical for {c['identical']}/"
                         f"{c['of']} prompts")
    return notes


def strip_outputs(obj):
    """The record without the token ids of every output (they go to the JSON's
    ``outputs`` section once, for the off runs)."""
    if isinstance(obj, dict):
        return {k: strip_outputs(v) for k, v in obj.items() if k != "outputs"}
    return obj


def main(argv: list[str] | None = None) -> int:
    from heron.bench.machine import machine_info

    args = parse_args(argv)
    t0 = time.time()
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tempfile.gettempdir()) / "vllm-cache"))
    machine = machine_info()
    workdir = Path(tempfile.mkdtemp(prefix="spec_decode-"))
    print(f"logs in {workdir}", file=sys.stderr)
    notes: list[str] = []

    # prompts, from heron's tokenizer (the "off" engine's, built first)
    pool = Pool(args)
    from heron import LLM  # noqa: F401 - fail early if heron does not import

    off_conf = make_conf("off", args, None)
    blocks, seqs = capacity(args, "off")
    pool.engines["off"] = make_heron(off_conf, args, blocks, seqs)
    off = pool.engines["off"]
    args.warm = off.apply_chat_template([{"role": "user", "content": "Say hello."}])
    pool.generate("off", [args.warm], 16)
    copy = copy_prompts(off, args.num_prompts)
    chat = chat_prompts(off, args.chat_prompts)
    chunks = chunk_prompts(off, max(args.batch_sizes), MAX_CHUNK_PROMPT, args.chunk_lines) \
        if "batch" in args.groups else []
    for w, ps in (("copy", copy), ("chat", chat), ("batch chunks", chunks)):
        if ps:
            lens = [len(p["ids"]) for p in ps]
            notes.append(f"{w} prompts: {len(ps)}, {min(lens)}-{max(lens)} tokens "
                         f"({', '.join(p['label'][:40] for p in ps[:8])}"
                         f"{', ...' if len(ps) > 8 else ''})")

    results: dict = {}
    if "copy" in args.groups:
        confs = [make_conf("off", args, None), make_conf("ngram", args, None)]
        results["copy"] = run_batch1("copy", pool, confs, args, copy, {})
    if "chat" in args.groups:
        confs, skipped = [make_conf("off", args, None)], {}
        for name in args.chat_methods:
            if name == "eagle" and not (args.eagle_head / "config.json").exists() and \
                    not args.eagle_head.is_dir():
                skipped[name] = f"skipped: no EAGLE head at {args.eagle_head} (--eagle-head)"
                notes.append(f"eagle row skipped: no EAGLE head at {args.eagle_head}")
                continue
            draft_dir = None
            if name == "draft":
                try:
                    draft_dir = args.draft_model or build_draft_dir(
                        args.draft_layers, Path(tempfile.gettempdir()) /
                        f"smollm2-draft-{args.draft_layers}l")
                except Exception:  # noqa: BLE001
                    skipped[name] = "draft model build failed: " + \
                        traceback.format_exc().strip().splitlines()[-1]
                    notes.append(f"draft model build failed:\n\n```\n"
                                 f"{traceback.format_exc().strip()}\n```")
                    continue
            confs.append(make_conf(name, args, draft_dir))
        results["chat"] = run_batch1("chat", pool, confs, args, chat, skipped)
        pool.close([c.name for c in confs if c.name not in ("off", "ngram")])
    if "batch" in args.groups:
        confs = [make_conf(n, args, None) for n in
                 ("off", "ngram", f"ngram+disable{args.disable_by_batch_size}")]
        results["batch"] = run_batch_rows(args, pool, chunks, confs)
    pool.close()  # heron freed before vLLM starts
    if "vllm" in args.groups:
        workloads = {"copy": copy, "chat": chat}
        try:
            results["vllm"] = run_vllm(args, workloads, args.warm, workdir)
        except Exception:  # noqa: BLE001 - keep heron's figures
            notes.append(f"vLLM rows failed:\n\n```\n{traceback.format_exc().strip()}\n```")
            results["vllm"] = {}
        cores = results["vllm"].pop("_cores", None)
        notes.append(f"vLLM 0.32.0 CPU build (own venv, `{args.hf_dir}` float32 export of the "
                     f"same GGUF), offline LLM.generate one prompt at a time; its OpenMP "
                     f"threads on cores {cores or '?'} (it reserves one core for its "
                     f"scheduler); vLLM spec config {json.dumps(NGRAM)}")
        for w in workloads:
            ng = results["vllm"][w].get("ngram", {})
            if "error" in ng:
                notes.append(f"vLLM ngram speculation on CPU failed ({w}): "
                             f"{ng['error'].strip().splitlines()[-1]}")

    batch = results.get("batch") or {}
    cross = crossover(batch, f"ngram+disable{args.disable_by_batch_size}") if batch \
        else "batch rows not run"
    if batch:
        pol = f"ngram+disable{args.disable_by_batch_size}"
        for b, r in sorted(batch.items()):
            if pol in r and r[pol].get("vs_off"):
                notes.append(f"batch {b}: {pol} / off = {r[pol]['vs_off']:.2f}x, "
                             f"ngram / off = {r.get('ngram', {}).get('vs_off', 0):.2f}x")
    notes = goal_notes(results) + correctness_notes(results) + agreement_notes(results) + notes
    command = "python benchmarks/spec_decode.py " + shlex.join(argv if argv is not None
                                                                else sys.argv[1:])
    record = {"kind": "spec_decode", "machine": machine, "command": command.strip(),
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in
                         vars(args).items() if k != "warm"},
              "workdir": str(workdir), "crossover": cross, "notes": notes,
              "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "wall_s": time.time() - t0,
              "prompts": {w: [{"label": p["label"], "tokens": len(p["ids"])} for p in ps]
                          for w, ps in (("copy", copy), ("chat", chat), ("batch", chunks))}}
    md = report(args, record | {"results": results})
    print(md)
    record["results"] = strip_outputs(results)
    # the off runs' token ids (every "on" run is compared with them: `same_as_off`)
    record["off_outputs"] = {f"{engine} {w}": src[w]["off"]["outputs"]
                             for engine, src in (("heron", results),
                                                 ("vllm", results.get("vllm", {})))
                             for w in ("copy", "chat")
                             if "outputs" in src.get(w, {}).get("off", {})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(md + "\n")
    print(f"figures: {args.out}, {args.out.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
