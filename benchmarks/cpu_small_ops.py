"""CPU fast path for the small ops: does torch.compile (inductor's CPU codegen) or hand-fusing
RMSNorm / rotary / residual / SiLU-and-mul make a CPU decode step faster?

    .venv/bin/python benchmarks/cpu_small_ops.py --model /tmp/smollm2-hf
    .venv/bin/python benchmarks/cpu_small_ops.py --variants eager,fused --reps 9 --no-check

One decode step = ``model(input_ids, positions)`` inside a forward context (the cpu attention
backend and its C++ paged attention kernel) + ``compute_logits`` on the sampled rows, for B
decode requests of ``--context`` tokens each (B in ``--batch-sizes``), plus one
``--prefill``-token prompt for reference. The setup copies what heron/worker/model_runner.py
does (per-layer KV caches, flat metadata, rotary tables reserved once) without the scheduler
or sampler.

Variants (each but ``fused`` on its own copy of the weights; timed interleaved, round by
round, in alternating order):

* ``eager``: heron's code as it is.
* ``fused``: the hand-fused torch formulas of this file patched in: residual add done in place
  into the sub-block output, rotary as ``x * cos`` + two in-place ``addcmul_`` (no neg / cat),
  SiLU-and-mul as ``silu(gate).mul_(up)``. (``fused-norm``, ``fused-rotary``, ``fused-silu``:
  one of them alone.)
* ``compiled``: ``heron.worker.compiled_forward.compile_forward(model, freeze_batched=False)``:
  inductor (default mode, fullgraph) of the whole forward, one graph for one-token steps and
  one with a dynamic token count; attention is the opaque custom op ``heron::attention``.
* ``compiled-hybrid``: ``compile_forward(model)``: the same, the multi-token graph compiled
  with inductor's freezing (constant, prepacked weights).
* ``compiled-freeze``: as ``compiled-hybrid`` with the one-token graph frozen too.
* ``eager-copy``: eager again, on its own copy of the weights: how far two identical variants
  drift apart on this machine (the noise floor of the ratios).
* (not offered: attention behind ``torch.compiler.disable``, i.e. one graph break per layer.
  The resume function after the break is one code object guarded on ``layer_idx``, so it
  recompiles per layer, hits dynamo's recompile limit (8) by layer 9 and then runs the rest
  eagerly -- and, sharing code objects, it knocked a fullgraph variant back to eager when both
  lived in one process. An eager forward through the ``heron::attention`` op cost the same as
  the direct backend call within noise: ~20 us per call, 0.6 ms of a 60 ms step.)

Reported: ms/step (wall clock and process CPU time, median and min over all steps) with
ratios to eager; the first call of each shape (the compile time of the compiled variants: a
fresh inductor cache unless ``--warm-cache``, which uses TORCHINDUCTOR_CACHE_DIR or the
default one); an eager breakdown of one step into its ops (GEMMs, attention, RMSNorm, rotary,
SiLU*mul, residual adds, logits, embedding, each timed alone; "other" = the step minus their
sum = Python/module overhead); the same model with tiny shapes (the framework floor); and
exactness: max |logits - eager logits| at every shape, greedy tokens of four chat prompts
against HF transformers, and the prompts' last-token logits against HF's.

On a shared 2-core machine time the variants in one run (they are interleaved) and read the
``eager-copy`` row before believing a ratio: two identical variants drifted apart by up to
~5% in medians and ~9% in minima there.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heron.attention import ForwardContext, forward_context  # noqa: E402
from heron.attention.metadata import AttentionMetadata  # noqa: E402
from heron.layers import norm as norm_mod  # noqa: E402
from heron.worker.compiled_forward import _own_forward, compile_forward  # noqa: E402
from heron.layers.rotary import RotaryEmbedding  # noqa: E402
from heron.loader.model_source import resolve_model  # noqa: E402
from heron.loader.weights import build_model, materialize_weights, optimize_layout  # noqa: E402
from heron.models import ModelArchConfig  # noqa: E402
from heron.models import llama as llama_mod  # noqa: E402

CPU = torch.device("cpu")
BLOCK = 16


# --------------------------------------------------------------------------------------------
# Setup: model, KV caches, metadata (a copy of what heron/runner does)
# --------------------------------------------------------------------------------------------

def load(path: str, load_format: str = "auto", hf_overrides: dict | None = None):
    source = resolve_model(path, load_format)
    cfg = {**source.hf_config, **(hf_overrides or {})}
    arch = ModelArchConfig.from_hf(cfg)
    model = build_model(arch, torch.float32, CPU)
    materialize_weights(model, source, load_format, torch.float32, 0)
    optimize_layout(model, CPU)
    return model


def prepare(model, max_context: int) -> None:
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reserve(max_context, CPU)


def clone_model(model):
    """An independent copy (own weight storage, same layout); the rotary tables come along."""
    twin = copy.deepcopy(model)
    if model.config.tie_word_embeddings:
        twin.lm_head.weight = twin.model.embed_tokens.weight
    return twin


class Workload:
    """KV caches for ``max_batch`` decode requests of ``context`` tokens plus one prefill."""

    def __init__(self, arch, max_batch: int, context: int, prefill: int, seed: int = 0):
        self.arch = arch
        self.context = context
        self.prefill_len = prefill
        self.blocks_per_req = -(-context // BLOCK)
        self.prefill_first_block = max_batch * self.blocks_per_req
        num_blocks = self.prefill_first_block + -(-max(prefill, 1024) // BLOCK) + 1
        shape = (2, num_blocks, BLOCK, arch.num_kv_heads, arch.head_dim)
        gen = torch.Generator().manual_seed(seed)
        # random K/V (not zeros) so attention outputs are not trivially equal across variants
        self.kv_caches = [torch.randn(shape, generator=gen) * 0.5 for _ in range(arch.num_layers)]
        self.gen = gen

    def decode(self, batch: int):
        """Inputs of a decode step of ``batch`` requests (request i: blocks i*k .. i*k+k-1)."""
        k = self.blocks_per_req
        tables = torch.arange(batch * k, dtype=torch.long).view(batch, k)
        pos = torch.full((batch,), self.context - 1, dtype=torch.long)
        slots = tables[torch.arange(batch), pos // BLOCK] * BLOCK + pos % BLOCK
        ids = torch.randint(3, self.arch.vocab_size, (batch,), generator=self.gen)
        seq = [self.context] * batch
        starts = list(range(batch + 1))

        def md():
            return AttentionMetadata(slots, tables, torch.tensor(seq), torch.tensor(starts),
                                     starts, [1] * batch, seq, BLOCK)
        return ids, pos, md, list(range(batch))

    def prefill(self, token_ids: torch.Tensor | None = None, start: int = 0, n: int | None = None):
        """One request in the prefill region: tokens start .. start+n-1 of ``token_ids``."""
        if token_ids is None:
            token_ids = torch.randint(3, self.arch.vocab_size, (self.prefill_len,),
                                      generator=self.gen)
        n = len(token_ids) - start if n is None else n
        total = start + n
        nb = -(-total // BLOCK)
        table = torch.arange(self.prefill_first_block, self.prefill_first_block + nb,
                             dtype=torch.long).view(1, nb)
        pos = torch.arange(start, total, dtype=torch.long)
        slots = table[0, pos // BLOCK] * BLOCK + pos % BLOCK
        ids = token_ids[start:total]

        def md():
            return AttentionMetadata(slots, table, torch.tensor([total]), torch.tensor([0, n]),
                                     [0, n], [n], [total], BLOCK)
        return ids, pos, md, [n - 1]


def run_step(fwd, model, backend, kv_caches, ids, pos, md_fn, rows):
    with forward_context(ForwardContext(md_fn(), kv_caches, backend)):
        hidden = fwd(ids, pos)
    return model.compute_logits(hidden[rows[0]:rows[-1] + 1])


# --------------------------------------------------------------------------------------------
# Hand-fused formulas (plain torch)
# --------------------------------------------------------------------------------------------

def fused_rmsnorm_forward(self, x, residual=None):
    """add + norm with the add in place into ``x`` (the sub-block's fresh output)."""
    if residual is None:
        return self._norm(x)
    x.add_(residual)
    return self._norm(x), x


def fused_apply_rotary(x, cos, sin):
    """x * cos + rotate_half(x) * sin in three kernels: no neg, no cat."""
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1.0)
    out[..., h:].addcmul_(x[..., :h], sin[..., h:])
    return out


def fused_silu_and_mul(gate_up):
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]).mul_(gate_up[..., d:])


@contextlib.contextmanager
def fused_ops(norm=True, rotary=True, silu=True):
    saved = (norm_mod.RMSNorm.forward, llama_mod.apply_rotary, llama_mod.silu_and_mul)
    if norm:
        norm_mod.RMSNorm.forward = fused_rmsnorm_forward
    if rotary:
        llama_mod.apply_rotary = fused_apply_rotary
    if silu:
        llama_mod.silu_and_mul = fused_silu_and_mul
    try:
        yield
    finally:
        norm_mod.RMSNorm.forward, llama_mod.apply_rotary, llama_mod.silu_and_mul = saved


# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------

class Variant:
    def __init__(self, name, model, fwd, ctx=contextlib.nullcontext, compiled=False):
        self.name, self.model, self.fwd, self.ctx, self.compiled = name, model, fwd, ctx, compiled
        self.first_call_s: dict[str, float] = {}

    def step(self, backend, kv, inputs):
        ids, pos, md_fn, rows = inputs
        with self.ctx():
            return run_step(self.fwd, self.model, backend, kv, ids, pos, md_fn, rows)


def make_variants(names, base, max_context):
    out = []
    for name in names:
        if name == "eager":
            out.append(Variant(name, base, base))
        elif name == "fused":
            out.append(Variant(name, base, base, ctx=fused_ops))
        elif name.startswith("fused-"):  # fused-norm, fused-rotary, fused-silu: one at a time
            which = name.split("-", 1)[1]
            flags = dict(norm=which == "norm", rotary=which == "rotary", silu=which == "silu")
            out.append(Variant(name, base, base, ctx=lambda f=flags: fused_ops(**f)))
        elif name in ("compiled", "compiled-hybrid"):
            m = clone_model(base)
            prepare(m, max_context)
            fwd = compile_forward(m, freeze_batched=name == "compiled-hybrid")
            out.append(Variant(name, m, fwd, compiled=True))
        elif name == "compiled-freeze":
            m = clone_model(base)
            prepare(m, max_context)
            out.append(Variant(name, m, _compile_all_frozen(m), compiled=True))
        elif name == "eager-copy":  # eager again on its own weights: the noise floor
            m = clone_model(base)
            prepare(m, max_context)
            out.append(Variant(name, m, m))
        else:
            raise SystemExit(f"unknown variant {name!r}")
    return out


def _compile_all_frozen(model):
    """compile_forward with the one-token graph frozen too."""
    import torch._inductor.config as inductor_config

    one = torch.compile(_own_forward(model, "bench_one_token_frozen"), dynamic=False,
                        fullgraph=True)
    many = torch.compile(_own_forward(model, "bench_tokens_frozen"), fullgraph=True)
    freezing = inductor_config.patch(freezing=True)

    def forward(input_ids, positions):
        with freezing:
            if input_ids.shape[0] == 1:
                return one(input_ids, positions)
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
            return many(input_ids, positions)
    return forward


# --------------------------------------------------------------------------------------------
# Eager breakdown: each op category of one step timed on its own, with the step's shapes
# --------------------------------------------------------------------------------------------

CLOCKS = ("wall", "cpu")


def timed(fn) -> dict[str, float]:
    """Seconds of one call: wall clock and CPU time of this process (all its threads). On a
    shared machine CPU time is the steadier measure of the work done (a descheduled process
    loses wall time, not CPU time); with several threads it includes OpenMP spin-waiting."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return dict(wall=time.perf_counter() - w0, cpu=time.process_time() - c0)


def _best_of(fn, reps: int) -> float:
    return statistics.median(timed(fn)["cpu"] for _ in range(reps))


def breakdown(model, backend, kv, inputs, reps: int) -> dict[str, float]:
    """Seconds per step of each op category, run on its own (30 layers' worth)."""
    cfg = model.config
    ids, pos, md_fn, rows = inputs
    T = ids.shape[0]
    layers = list(model.model.layers)
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hidden = torch.randn(T, cfg.hidden_size) * 0.1
    resid = torch.randn(T, cfg.hidden_size)
    gate_up = torch.randn(T, 2 * cfg.intermediate_size)
    act = torch.randn(T, cfg.intermediate_size)
    qkv = torch.randn(T, H + 2 * KVH, D)
    qk, v = qkv.split([H + KVH, KVH], dim=1)
    attn_out = torch.randn(T, H * D)
    cos, sin = model.model.rotary_emb(pos, torch.float32)
    q, k = qk.split([H, KVH], dim=1)
    eps = cfg.rms_norm_eps

    def gemms():
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            F.linear(hidden, a.qkv_proj.weight)
            F.linear(attn_out, a.o_proj.weight)
            F.linear(hidden, mlp.gate_up_proj.weight)
            F.linear(act, mlp.down_proj.weight)

    def attention():
        md = md_fn()
        for i, layer in enumerate(layers):
            backend.forward(q, k, v, kv[i], md, layer.self_attn.scale, None)

    def rmsnorm():  # 2 per layer + the final norm; add excluded
        for layer in layers:
            F.rms_norm(hidden, (cfg.hidden_size,), layer.input_layernorm.weight, eps)
            F.rms_norm(hidden, (cfg.hidden_size,), layer.post_attention_layernorm.weight, eps)
        F.rms_norm(hidden, (cfg.hidden_size,), model.model.norm.weight, eps)

    def residual_adds():  # 2 per layer (the first layer's input norm has none) + final
        for _ in range(2 * len(layers)):
            hidden + resid

    def rotary():
        model.model.rotary_emb(pos, torch.float32)
        for _ in layers:
            llama_mod.apply_rotary(qk, cos, sin)

    def silu_mul():
        for _ in layers:
            llama_mod.silu_and_mul(gate_up)

    def logits():
        model.compute_logits(hidden[rows[0]:rows[-1] + 1])

    def embedding():
        model.model.embed_tokens(ids)

    parts = dict(gemm=gemms, attention=attention, rmsnorm=rmsnorm, residual_add=residual_adds,
                 rotary=rotary, silu_mul=silu_mul, logits=logits, embedding=embedding)
    return {name: _best_of(fn, reps) for name, fn in parts.items()}


# --------------------------------------------------------------------------------------------
# Exactness
# --------------------------------------------------------------------------------------------

def greedy(variant, backend, wl: Workload, prompt: list[int], n_new: int) -> list[int]:
    tokens = torch.tensor(prompt, dtype=torch.long)
    out = []
    inputs = wl.prefill(tokens)
    for i in range(n_new):
        logits = variant.step(backend, wl.kv_caches, inputs)
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        tokens = torch.cat([tokens, torch.tensor([nxt])])
        inputs = wl.prefill(tokens, start=len(tokens) - 1, n=1)
    return out


CHATS = ("What is the capital of France?", "Write a short poem about the sea.",
         "Explain in two sentences why the sky is blue.",
         "List three prime numbers and say why they are prime.")


def hf_reference(path: str, prompts: list[list[int]], n_new: int):
    """HF transformers (float32): greedy continuations and each prompt's last-token logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                              do_sample=False, eos_token_id=None, pad_token_id=2)
            tokens.append(seq[0, len(prompt):].tolist())
            logits.append(hf(ids).logits[0, -1].float())
    return tokens, logits


def chat_prompts(path: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [list(tok.apply_chat_template([{"role": "user", "content": c}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]) for c in CHATS]


# --------------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/tmp/smollm2-hf")
    p.add_argument("--variants",
                   default="eager,eager-copy,fused,compiled,compiled-hybrid,compiled-freeze")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--prefill", type=int, default=512, help="0: no prefill shape")
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--no-tiny", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--warm-cache", action="store_true",
                   help="reuse the inductor cache (default: a fresh one: cold compile times)")
    p.add_argument("--json-out")
    args = p.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    from heron.attention import get_attention_backend

    torch.manual_seed(0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    names = args.variants.split(",")
    backend = get_attention_backend("cpu", CPU)
    record: dict = dict(threads=torch.get_num_threads(), torch=torch.__version__,
                        context=args.context, prefill=args.prefill)

    with torch.inference_mode():
        base = load(args.model)
        max_context = max(args.context, args.prefill, 1024) + 64
        prepare(base, max_context)
        wl = Workload(base.config, max(batch_sizes), args.context, args.prefill)
        shapes = {f"decode B={b}": wl.decode(b) for b in batch_sizes}
        if args.prefill:
            shapes[f"prefill {args.prefill}"] = wl.prefill()
        variants = make_variants(names, base, max_context)

        # first calls: compile (cold cache) per shape, in the order a server meets them
        for v in variants:
            for shape, inputs in shapes.items():
                t0 = time.perf_counter()
                v.step(backend, wl.kv_caches, inputs)
                v.first_call_s[shape] = time.perf_counter() - t0
            print(f"# first calls {v.name}: " +
                  ", ".join(f"{s} {t:.2f}s" for s, t in v.first_call_s.items()), flush=True)
        record["first_call_s"] = {v.name: v.first_call_s for v in variants}
        try:
            from torch._dynamo.utils import counters
            record["unique_graphs"] = int(counters["stats"]["unique_graphs"])
        except Exception:  # noqa: BLE001
            pass

        # exactness at every shape: max |logits - eager logits|, argmax agreement
        ref = {s: variants[0].step(backend, wl.kv_caches, i) for s, i in shapes.items()}
        diffs = {}
        for v in variants[1:]:
            for s, i in shapes.items():
                got = v.step(backend, wl.kv_caches, i)
                diffs[f"{v.name} | {s}"] = dict(
                    max_abs=float((got - ref[s]).abs().max()),
                    argmax_equal=bool((got.argmax(-1) == ref[s].argmax(-1)).all()))
        record["logit_diffs_vs_" + variants[0].name] = diffs

        # timing: interleaved rounds; wall clock and process CPU time per step
        times = {(c, v.name, s): [] for c in CLOCKS for v in variants for s in shapes}
        for rnd in range(args.reps):
            for s, inputs in shapes.items():
                order = variants if rnd % 2 == 0 else variants[::-1]
                for v in order:
                    for _ in range(args.steps if not s.startswith("prefill") else 1):
                        for c, t in timed(lambda: v.step(backend, wl.kv_caches, inputs)).items():
                            times[(c, v.name, s)].append(t)
        first = variants[0].name
        for c in CLOCKS:
            med = {(n, s): statistics.median(times[(c, n, s)]) for _, n, s in times if _ == c}
            low = {(n, s): min(times[(c, n, s)]) for _, n, s in times if _ == c}
            record[f"ms_per_step_{c}"] = {f"{n} | {s}": 1e3 * t for (n, s), t in med.items()}
            record[f"ms_per_step_{c}_min"] = {f"{n} | {s}": 1e3 * t for (n, s), t in low.items()}
            for label, table in (("median", med), ("min", low)):
                print(f"\n## {c} ms/step, {label} of {args.reps} interleaved rounds x "
                      f"{args.steps} steps; {torch.get_num_threads()} threads; "
                      f"ratio = {first} / variant (>1: faster)")
                print(f"{'variant':18s}" + "".join(f"{s:>24s}" for s in shapes))
                for v in variants:
                    print(f"{v.name:18s}" + "".join(
                        f"{1e3 * table[(v.name, s)]:14.2f} "
                        f"({table[(first, s)] / table[(v.name, s)]:5.3f}x)" for s in shapes))
        med = {(n, s): statistics.median(times[("cpu", n, s)]) for _, n, s in times if _ == "cpu"}
        print("\n## first call per shape (s; compile time for compiled variants)")
        for v in variants:
            print(f"{v.name:18s}" + "".join(f"{t:24.2f}" for t in v.first_call_s.values()))
        print("\n## max |logits - " + first + "| and argmax agreement")
        for k, d in diffs.items():
            print(f"{k:40s} {d['max_abs']:.3e}  argmax equal: {d['argmax_equal']}")

        if not args.no_breakdown:
            print("\n## eager breakdown (CPU ms/step, each op category timed alone, 30 layers;"
                  " other = eager step CPU time - their sum)")
            record["breakdown_ms"] = {}
            for s, inputs in shapes.items():
                parts = breakdown(base, backend, wl.kv_caches, inputs, max(5, args.reps))
                step = med[("eager", s)] if ("eager", s) in med else None
                total = sum(parts.values())
                row = {k: 1e3 * t for k, t in parts.items()}
                if step is not None:
                    row["other (python/modules)"] = 1e3 * (step - total)
                    row["step"] = 1e3 * step
                record["breakdown_ms"][s] = row
                print(f"{s}: " + ", ".join(f"{k} {t:.2f}" for k, t in row.items()))

        if not args.no_tiny:
            # the same 30-layer graph with tiny shapes: per-op dispatch + Python, no arithmetic
            tiny = load(args.model, "dummy", dict(hidden_size=72, intermediate_size=64,
                                                  vocab_size=256, head_dim=8))
            prepare(tiny, max_context)
            twl = Workload(tiny.config, 1, args.context, 0)
            tin = twl.decode(1)
            tv = make_variants([n for n in names if n in ("eager", "fused", "compiled")],
                               tiny, max_context)
            for v in tv:
                v.step(backend, twl.kv_caches, tin)
            tt = {v.name: [] for v in tv}
            for _ in range(args.reps * 5):
                for v in tv:
                    tt[v.name].append(timed(lambda: v.step(backend, twl.kv_caches, tin))["cpu"])
            record["tiny_decode_ms"] = {n: 1e3 * statistics.median(t) for n, t in tt.items()}
            print("\n## tiny shapes (hidden 72, 30 layers), decode B=1: framework floor, "
                  "CPU ms/step")
            print(", ".join(f"{n} {t:.2f}" for n, t in record["tiny_decode_ms"].items()))

        if not args.no_check:
            prompts = chat_prompts(args.model)
            ref_tokens, ref_logits = hf_reference(args.model, prompts, args.new_tokens)
            record["greedy_equals_hf"], record["prompt_logits_vs_hf"] = {}, {}
            for v in variants:
                same = [greedy(v, backend, wl, p, args.new_tokens) == r
                        for p, r in zip(prompts, ref_tokens)]
                record["greedy_equals_hf"][v.name] = all(same)
                diff = max(float((v.step(backend, wl.kv_caches, wl.prefill(torch.tensor(p)))[-1]
                                  - r).abs().max()) for p, r in zip(prompts, ref_logits))
                record["prompt_logits_vs_hf"][v.name] = diff
            print(f"\n## {len(prompts)} chat prompts x {args.new_tokens} greedy tokens "
                  "identical to HF transformers: " + ", ".join(
                      f"{n} {ok}" for n, ok in record["greedy_equals_hf"].items()))
            print("max |last-token prompt logits - HF's|: " + ", ".join(
                f"{n} {d:.2e}" for n, d in record["prompt_logits_vs_hf"].items()))

    print(json.dumps(record))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
