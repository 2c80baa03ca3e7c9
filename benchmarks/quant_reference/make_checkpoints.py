#!/usr/bin/env python3
"""Build tiny quantized reference checkpoints with the tools that publish these formats.

Run inside the *peer* venv (never heron's own venv; ``make reference-tools`` builds it from
``requirements.txt``, ``requirements-no-deps.txt`` and ``constraints.txt`` here)::

    make reference-tools
    .venv/peers/quant/bin/python benchmarks/quant_reference/make_checkpoints.py --out /tmp/quant_ref

``tests/reference_tools/test_quant_reference_tools.py`` runs it (``--calib-samples 16``) and compares heron's
logprobs on each checkpoint with ``reference_logits.pt``; it also runs ``--reference-dirs`` on
``heron quantize``'s output to get HF's logits there.

It writes, under ``--out``:

* ``fp32/``            the unquantized tiny random LlamaForCausalLM (+ a tiny word-level tokenizer)
* ``ct-*/``            llmcompressor / compressed-tensors checkpoints (saved compressed)
* ``gptq-*/``          GPTQModel checkpoints (GPTQ v1 on-disk format)
* ``awq-gemm/``        AutoAWQ GEMM checkpoint (GPTQModel's AWQ exporter when AutoAWQ does not
                       import; ``PRODUCER`` names the tool)

and, in every directory, ``reference_logits.pt`` = ``{"input_ids": LongTensor[2,16],
"logits": FloatTensor[2,16,vocab], ...}`` computed by loading the directory back with plain
``transformers.AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`` on CPU (HF dispatches to
compressed-tensors / gptqmodel for the dequantization).  Extra keys:

* ``logits_weight_only`` (compressed-tensors schemes with quantized activations): the same model
  with compressed-tensors' activation fake-quant switched off.  ``logits`` *includes* the
  activation QDQ (dynamic per-token int8/fp8, or static per-tensor fp8 with ``input_scale``).
* ``logits_auto_kernel`` (GPTQ/AWQ): ``logits`` uses gptqmodel's plain torch kernel (GPTQ: weight
  dequantized in the fp16 scale dtype, fp32 matmul; AWQ: activations cast to fp16, fp16 matmul);
  this one uses the kernel HF picks by default on CPU, which computes in bf16.

The last stdout line is a JSON summary (also written to ``<out>/summary.json``).

Each tool's quantizations run in a subprocess of their own, and so do the reference loads of
each format family (compressed-tensors; GPTQ and AWQ, through gptqmodel), so that one tool's
monkey-patching cannot affect another's checkpoint, nor the HF loads; a failing checkpoint does
not stop the others of its tool (``--isolate``: one process per checkpoint and per load, at tens
of seconds of imports each; ``--jobs N``: N children at a time).  Nothing is downloaded:
calibration data are random token ids built in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# GPTQModel 7.6 sizes its CPU pool as (cpu_count+1)//2 but always asks for a 2-worker
# "model_loader:cpu" sub-pool, which raises on machines with <= 2 cores.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
# gptqmodel's torch kernels torch.compile their dequantization (inductor: a C++ build, ~20 s per
# process on CPU); eager gives the same arithmetic (fp16 dequantization, matmul in the input dtype).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

SEED = 1234
VOCAB = 512
CALIB_SAMPLES = 32
CALIB_LEN = 64
REF_BATCH, REF_LEN = 2, 16

TINY_LLAMA = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    # Larger than HF's 0.02 default so logits are O(1) and quantization error is visible.
    initializer_range=0.05,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# name -> (tool, kwargs).  Order matters only for printing.
CHECKPOINTS: dict[str, tuple[str, dict]] = {
    "ct-w8a8": ("llmcompressor", dict(scheme="W8A8", smoothquant=True, gptq=True)),
    "ct-fp8-dynamic": ("llmcompressor", dict(scheme="FP8_DYNAMIC", calibrate=False)),
    "ct-fp8": ("llmcompressor", dict(scheme="FP8")),
    "ct-w4a16": ("llmcompressor", dict(scheme="W4A16", gptq=True)),
    "ct-w4a16-asym": ("llmcompressor", dict(scheme="W4A16_ASYM", gptq=True)),
    "ct-w8a16": ("llmcompressor", dict(scheme="W8A16", gptq=True)),
    "gptq-4bit-g32": ("gptqmodel", dict(bits=4, group_size=32, sym=True, desc_act=False)),
    "gptq-4bit-g32-asym": ("gptqmodel", dict(bits=4, group_size=32, sym=False, desc_act=False)),
    "gptq-8bit": ("gptqmodel", dict(bits=8, group_size=64, sym=True, desc_act=False)),
    "gptq-desc-act": ("gptqmodel", dict(bits=4, group_size=32, sym=True, desc_act=True)),
    "awq-gemm": ("autoawq", dict(w_bit=4, q_group_size=64, zero_point=True, version="GEMM")),
}

INSPECT_MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")


def _torch():
    import torch

    torch.set_num_threads(1)
    return torch


def calib_token_ids() -> list[list[int]]:
    torch = _torch()
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(3, VOCAB, (CALIB_SAMPLES, CALIB_LEN), generator=g)
    return ids.tolist()


def reference_input_ids():
    torch = _torch()
    torch.manual_seed(0)
    return torch.randint(0, VOCAB, (REF_BATCH, REF_LEN))


# --------------------------------------------------------------------------------------------
# fp32 base model


def build_fp32(out: Path) -> None:
    torch = _torch()
    from transformers import LlamaConfig, LlamaForCausalLM

    d = out / "fp32"
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = LlamaConfig(**TINY_LLAMA)
    cfg.dtype = "float32"
    model = LlamaForCausalLM(cfg).eval()
    # Non-trivial norm weights, so a loader that skips them is caught.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(d, safe_serialization=True)
    _save_tokenizer(d)


def _save_tokenizer(d: Path) -> None:
    """Tiny word-level tokenizer ("t0".."t511"); some tools insist on a tokenizer in the dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<unk>"], vocab["<s>"], vocab["</s>"] = 0, 1, 2
    vocab = {k: v for k, v in vocab.items() if k not in ("t0", "t1", "t2")}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    fast.save_pretrained(d)


# --------------------------------------------------------------------------------------------
# llmcompressor (compressed-tensors)


def quant_llmcompressor(out: Path, name: str, scheme: str, smoothquant=False, gptq=False, calibrate=True):
    torch = _torch()
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "fp32", dtype=torch.float32)
    recipe = []
    if smoothquant:
        try:
            from llmcompressor.modifiers.transform import SmoothQuantModifier
        except ImportError:  # older llmcompressor
            from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
        recipe.append(SmoothQuantModifier(smoothing_strength=0.8))
    mod = GPTQModifier if gptq else QuantizationModifier
    recipe.append(mod(targets="Linear", scheme=scheme, ignore=["lm_head"]))

    kwargs = {}
    if calibrate:
        ids = calib_token_ids()
        ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
        kwargs = dict(dataset=ds, num_calibration_samples=len(ids), max_seq_length=CALIB_LEN,
                      shuffle_calibration_samples=False)  # unseeded shuffle -> run-to-run drift
    oneshot(model=model, recipe=recipe, **kwargs)
    d = out / name
    model.save_pretrained(d, save_compressed=True)
    _save_tokenizer(d)


# --------------------------------------------------------------------------------------------
# GPTQModel


def quant_gptqmodel(out: Path, name: str, bits: int, group_size: int, sym: bool, desc_act: bool):
    _torch()
    from gptqmodel import GPTQModel, QuantizeConfig

    qcfg = QuantizeConfig(bits=bits, group_size=group_size, sym=sym, desc_act=desc_act, device="cpu")
    model = GPTQModel.load(str(out / "fp32"), qcfg)
    calib = [{"input_ids": x, "attention_mask": [1] * len(x)} for x in calib_token_ids()]
    model.quantize(calib, batch_size=1)
    model.save(str(out / name))
    _save_tokenizer(out / name)


# --------------------------------------------------------------------------------------------
# AutoAWQ (deprecated upstream); falls back to GPTQModel's AWQ GEMM exporter.


def quant_autoawq(out: Path, name: str, **quant_config):
    """AutoAWQ's GEMM checkpoint.  Only when AutoAWQ does not import (it is deprecated upstream
    and may not install against a given torch) does GPTQModel's AWQ GEMM exporter write it
    instead; ``PRODUCER`` says which tool wrote it.  A failure of AutoAWQ itself is an error."""
    _torch()
    d = out / name
    try:
        from awq import AutoAWQForCausalLM
    except Exception as e:  # noqa: BLE001  (ImportError, or a kernel-extension load error)
        print(f"[awq] AutoAWQ does not import ({type(e).__name__}: {e}); using GPTQModel's AWQ "
              f"exporter", file=sys.stderr)
        _gptqmodel_awq(out, name, quant_config)
        (d / "PRODUCER").write_text(f"gptqmodel-awq (autoawq not importable: {type(e).__name__}: {e})\n")
        _save_tokenizer(d)
        return
    from transformers import AutoTokenizer

    model = AutoAWQForCausalLM.from_pretrained(str(out / "fp32"), device_map="cpu")
    tok = AutoTokenizer.from_pretrained(str(out / "fp32"))
    model.quantize(
        tok,
        quant_config=quant_config,
        calib_data=calib_token_ids(),
        n_parallel_calib_samples=None,
        max_calib_samples=CALIB_SAMPLES,
        max_calib_seq_len=CALIB_LEN,
    )
    model.save_quantized(str(d))
    (d / "PRODUCER").write_text("autoawq\n")
    _save_tokenizer(d)


def _gptqmodel_awq(out: Path, name: str, quant_config: dict) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization import FORMAT, METHOD

    qcfg = QuantizeConfig(
        bits=quant_config["w_bit"],
        group_size=quant_config["q_group_size"],
        sym=not quant_config["zero_point"],
        quant_method=METHOD.AWQ,
        format=FORMAT.GEMM,
        device="cpu",
    )
    model = GPTQModel.load(str(out / "fp32"), qcfg)
    calib = [{"input_ids": x, "attention_mask": [1] * len(x)} for x in calib_token_ids()]
    model.quantize(calib, batch_size=1)
    model.save(str(out / name))


# --------------------------------------------------------------------------------------------
# reference logits + inspection


# gptqmodel kernels HF picks on CPU by default ("TorchAtenLinear"/"TorchAtenAwqLinear") cast
# activations *and scales* to bf16; the plain torch kernels dequantize in the checkpoint's fp16
# scale dtype and matmul in the activation dtype (fp32 here), so they are the tighter reference.
PRECISE_BACKEND = {"gptq": "torch", "awq": "torch_awq"}


def load_hf(d: Path, precise: bool = True):
    """Load ``d`` with plain HF transformers (float32, CPU).  For GPTQ/AWQ, ``precise`` selects
    gptqmodel's torch kernel instead of HF's auto-selected one."""
    torch = _torch()
    from transformers import AutoModelForCausalLM

    qc = json.loads((d / "config.json").read_text()).get("quantization_config") or {}
    kw = {}
    if precise and qc.get("quant_method") in PRECISE_BACKEND:
        from transformers import AwqConfig, GPTQConfig

        cls = AwqConfig if qc["quant_method"] == "awq" else GPTQConfig
        kw["quantization_config"] = cls.from_dict({**qc, "backend": PRECISE_BACKEND[qc["quant_method"]]})
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, device_map="cpu", **kw).eval()


def _linear_classes(model) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})


def write_reference(d: Path) -> None:
    torch = _torch()
    model = load_hf(d)
    ids = reference_input_ids()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    ref = {"input_ids": ids, "logits": logits, "hf_linear_classes": _linear_classes(model)}
    qdq = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    if any(getattr(m.quantization_scheme, "input_activations", None) for m in qdq):
        # compressed-tensors simulates activation quantization (QDQ) in the wrapped forward; also
        # record logits with it switched off (dequantized weights only) for loaders that keep
        # activations in full precision.
        for m in qdq:
            m.quantization_enabled = False
        with torch.no_grad():
            ref["logits_weight_only"] = model(input_ids=ids).logits.float()
    qc = json.loads((d / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") in PRECISE_BACKEND:
        del model
        auto = load_hf(d, precise=False)
        with torch.no_grad():
            ref["logits_auto_kernel"] = auto(input_ids=ids).logits.float()
        ref["auto_kernel_linear_classes"] = _linear_classes(auto)
    torch.save(ref, d / "reference_logits.pt")


def inspect_dir(d: Path) -> dict:
    from safetensors import safe_open

    info: dict = {}
    cfg = json.loads((d / "config.json").read_text())
    info["quantization_config"] = cfg.get("quantization_config")
    info["files"] = sorted(p.name for p in d.iterdir() if p.is_file())
    tensors = {}
    for st in sorted(d.glob("*.safetensors")):
        with safe_open(st, "pt") as f:
            for k in f.keys():
                if any(k.startswith(m + ".") for m in INSPECT_MODULES):
                    t = f.get_slice(k)
                    tensors[k] = [t.get_dtype(), list(t.get_shape())]
            info.setdefault("n_tensors", 0)
            info["n_tensors"] += len(list(f.keys()))
    info["layer_tensors"] = dict(sorted(tensors.items()))
    return info


QUANTIZERS = {"llmcompressor": quant_llmcompressor, "gptqmodel": quant_gptqmodel, "autoawq": quant_autoawq}


def _ref_family(name: str) -> str:
    """HF loads compressed-tensors through the compressed-tensors package, GPTQ and AWQ through
    gptqmodel: one reference process per family."""
    return "ct" if CHECKPOINTS[name][0] == "llmcompressor" else "gptq-awq"


def _each(kind: str, names: list[str], work, logs: Path) -> None:
    """In a child process: ``work(name)`` for each name, one failure not stopping the rest;
    the outcome of each goes to ``logs/<name>.<kind>.json``."""
    failed = False
    for n in names:
        t0 = time.time()
        err = None
        try:
            work(n)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            err = f"{type(e).__name__}: {e}"[:600]
            failed = True
        (logs / f"{n}.{kind}.json").write_text(json.dumps({"seconds": round(time.time() - t0, 1),
                                                           "error": err}))
        print(f"[{kind} {n}] {'ok' if err is None else 'FAILED ' + err}", file=sys.stderr, flush=True)
    sys.exit(1 if failed else 0)


def _run_child(args: list[str], log: Path, timeout: int) -> tuple[int, float, str]:
    t0 = time.time()
    with open(log, "w") as fh:
        try:
            p = subprocess.run([sys.executable, __file__, *args], stdout=fh, stderr=subprocess.STDOUT,
                               timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = -9
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return rc, time.time() - t0, " | ".join(tail)[-600:]


def _run_batch(kind: str, label: str, names: list[str], common: list[str], logs: Path,
               timeout: int) -> tuple[dict[str, dict], float]:
    """One child for a batch of checkpoints -> ({name: {"seconds", "error"}}, wall seconds)."""
    for n in names:
        (logs / f"{n}.{kind}.json").unlink(missing_ok=True)
    rc, dt, tail = _run_child([*common, f"--_{kind}", ",".join(names)], logs / f"{label}.{kind}.log",
                              timeout)
    status: dict[str, dict] = {}
    for n in names:
        f = logs / f"{n}.{kind}.json"
        if f.exists():
            status[n] = json.loads(f.read_text())
        else:  # the child died (timeout, crash) before finishing this one
            status[n] = {"seconds": None, "error": f"{kind} process rc={rc} ({dt:.0f}s): {tail}"}
    print(f"[{kind} {label}] rc={rc} {dt:.0f}s", file=sys.stderr, flush=True)
    return status, round(dt, 1)


def _run_all(quant_batches: dict[str, list[str]], ref_batches: dict[str, list[str]], out: Path,
             common: list[str], logs: Path, timeout: int, jobs: int):
    """Quantize every batch, then load back each reference batch as soon as the quantizations
    it needs are done; up to ``jobs`` children at a time -> (quant status, ref status, walls)."""
    from concurrent.futures import ThreadPoolExecutor

    walls: dict[str, float] = {}

    def run(kind, label, names):
        status, walls[f"{kind} {label}"] = _run_batch(kind, label, names, common, logs, timeout)
        return status

    # Quantizations are submitted first and the pool is FIFO, so a reference task waiting on
    # them never holds back one that has not started.
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        qf = {label: pool.submit(run, "quant", label, b) for label, b in quant_batches.items()}

        def ref_task(label, names):
            done: dict[str, dict] = {}
            for ql, qb in quant_batches.items():
                if set(qb) & set(names):
                    done.update(qf[ql].result())
            ready = [n for n in names if done[n]["error"] is None and (out / n / "config.json").exists()]
            return run("ref", label, ready) if ready else {}

        rf = [pool.submit(ref_task, label, b) for label, b in ref_batches.items()]
        quant = {n: st for f in qf.values() for n, st in f.result().items()}
        refs = {n: st for f in rf for n, st in f.result().items()}
    return quant, refs, walls


def main() -> None:
    global CALIB_SAMPLES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="directory to write the checkpoints into")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(CHECKPOINTS))
    ap.add_argument("--timeout", type=int, default=900, help="per-subprocess timeout (s)")
    ap.add_argument("--calib-samples", type=int, default=CALIB_SAMPLES,
                    help=f"calibration sequences of {CALIB_LEN} random tokens ({CALIB_SAMPLES})")
    ap.add_argument("--isolate", action="store_true",
                    help="one process per quantization and per reference load (default: one per "
                         "tool, which saves the tools' import time, tens of seconds each)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="child processes at a time (1); the tools' imports are single-threaded")
    ap.add_argument("--reference-dirs", default="",
                    help="instead: write reference_logits.pt (HF transformers' logits) into each of "
                         "these comma-separated existing checkpoint directories, in this process "
                         "(e.g. `heron quantize` output); exit status 1 if any fails to load")
    ap.add_argument("--_quant", help=argparse.SUPPRESS)
    ap.add_argument("--_ref", help=argparse.SUPPRESS)
    a = ap.parse_args()
    CALIB_SAMPLES = a.calib_samples

    if a.reference_dirs:
        dirs = [Path(d) for d in a.reference_dirs.split(",") if d]
        failed = []
        for d in dirs:
            try:
                write_reference(d)
                print(f"[ref {d}] ok", file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                failed.append(str(d))
        print(json.dumps({"reference_dirs": [str(d) for d in dirs], "failed": failed}))
        sys.exit(1 if failed else 0)
    if a.out is None:
        ap.error("--out is required")
    out: Path = a.out.resolve()
    logs = out / "logs"

    def quantize_one(n: str) -> None:
        import shutil

        tool, kw = CHECKPOINTS[n]
        try:
            QUANTIZERS[tool](out, n, **kw)
        except BaseException:
            shutil.rmtree(out / n, ignore_errors=True)  # never leave half a checkpoint behind
            raise

    if a._quant:
        _each("quant", a._quant.split(","), quantize_one, logs)
    if a._ref:
        _each("ref", a._ref.split(","), lambda n: write_reference(out / n), logs)

    t_start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    names = [n for n in (a.only.split(",") if a.only else CHECKPOINTS) if n]
    for n in names:
        if n not in CHECKPOINTS:
            ap.error(f"unknown checkpoint {n!r}")

    torch = _torch()
    build_fp32(out)
    write_reference(out / "fp32")
    ref = torch.load(out / "fp32" / "reference_logits.pt")
    summary: dict = {"out": str(out), "calib_samples": CALIB_SAMPLES, "checkpoints": {}, "processes": {}}
    summary["checkpoints"]["fp32"] = {"written": True, "logit_std": float(ref["logits"].std()),
                                      **inspect_dir(out / "fp32")}
    common = ["--out", str(out), "--calib-samples", str(CALIB_SAMPLES)]

    def batches(key) -> dict[str, list[str]]:
        if a.isolate:
            return {n: [n] for n in names}
        groups: dict[str, list[str]] = {}
        for n in names:
            groups.setdefault(key(n), []).append(n)
        return groups

    quant, refs, summary["processes"] = _run_all(
        batches(lambda n: CHECKPOINTS[n][0]), batches(_ref_family), out, common, logs, a.timeout,
        a.jobs)
    names_written = {n for n in names if quant[n]["error"] is None and (out / n / "config.json").exists()}

    for n in names:
        ent: dict = {"tool": CHECKPOINTS[n][0], "quant_s": quant[n]["seconds"]}
        d = out / n
        if n not in names_written:
            ent.update(written=False, error=f"quantize: {quant[n]['error'] or 'no config.json written'}")
            summary["checkpoints"][n] = ent
            print(f"[{n}] FAILED quantize: {ent['error']}", file=sys.stderr, flush=True)
            continue
        ent["written"] = True
        if (d / "PRODUCER").exists():
            ent["producer"] = (d / "PRODUCER").read_text().strip()
        ent["ref_s"] = refs[n]["seconds"]
        if refs[n]["error"] is None and (d / "reference_logits.pt").exists():
            r = torch.load(d / "reference_logits.pt")
            assert torch.equal(r["input_ids"], ref["input_ids"])
            ent["max_abs_logit_diff_vs_fp32"] = float((r["logits"] - ref["logits"]).abs().max())
            if "logits_weight_only" in r:
                ent["max_abs_logit_diff_weight_only_vs_fp32"] = float(
                    (r["logits_weight_only"] - ref["logits"]).abs().max())
                ent["max_abs_logit_diff_act_qdq_vs_weight_only"] = float(
                    (r["logits_weight_only"] - r["logits"]).abs().max())
            ent["hf_linear_classes"] = r.get("hf_linear_classes")
            if "logits_auto_kernel" in r:
                ent["auto_kernel_linear_classes"] = r["auto_kernel_linear_classes"]
                ent["max_abs_logit_diff_auto_kernel_vs_precise"] = float(
                    (r["logits_auto_kernel"] - r["logits"]).abs().max())
        else:
            ent["ref_error"] = f"HF load: {refs[n]['error'] or 'no reference_logits.pt written'}"
        ent.update(inspect_dir(d))
        summary["checkpoints"][n] = ent
        print(f"[{n}] ok quant={ent['quant_s']}s ref={ent['ref_s']}s "
              f"diff={ent.get('max_abs_logit_diff_vs_fp32')}", file=sys.stderr, flush=True)

    summary["total_s"] = round(time.time() - t_start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
