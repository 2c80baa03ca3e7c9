"""heron against the reference quantization tools, in both directions.

* Tools -> heron: llm-compressor (compressed-tensors W8A8, FP8, FP8_DYNAMIC, W4A16, W8A16),
  GPTQModel (GPTQ v1) and AutoAWQ (AWQ GEMM) quantize a tiny random Llama
  (``benchmarks/quant_reference/make_checkpoints.py``, which also records the logits HF
  transformers computes on each checkpoint); heron loads each checkpoint and its prompt
  logprobs must match HF's within the format's tolerance.
* heron -> HF: ``heron quantize`` (GPTQ, AWQ, SmoothQuant W8A8, FP8) on the same float model;
  HF transformers, in the tools' venv, loads heron's output and its logits must match heron's.

The tools live in a test-only venv, never heron's: ``make reference-tools`` builds
``.venv/peers/quant``; ``HERON_REFERENCE_TOOLS_PYTHON`` names another interpreter. Without it
these tests skip, unless ``HERON_REQUIRE_REFERENCE_TOOLS=1`` (CI) makes that a failure.
Select them with ``-m reference_tools``. Slow part: the tools' imports (tens of seconds each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.reference_tools

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "quant_reference" / "make_checkpoints.py"
DEFAULT_TOOL_PYTHON = REPO / ".venv" / "peers" / "quant" / "bin" / "python"
# AutoAWQ is not among them: where it does not import, GPTQModel's AWQ exporter stands in
# (make_checkpoints.py says so in awq-gemm/PRODUCER); `make reference-tools` checks it imports.
TOOL_MODULES = ("torch", "transformers", "llmcompressor", "compressed_tensors", "gptqmodel")
CALIB_SAMPLES = 16  # random-token sequences of 64; the comparisons do not depend on their count
CHILD_TIMEOUT_S = 600  # each of make_checkpoints.py's tool processes (20-30 s each here)
TIMEOUT_S = 900  # the whole make_checkpoints.py run (about 2 minutes on 2 cores)
# Children of make_checkpoints.py at a time: one per tool at most, half the cores (the tools'
# imports are single-threaded; on a 2-core machine they run one after another).
JOBS = max(1, min(3, (os.cpu_count() or 2) // 2))
TOP_K = 20  # heron's prompt logprobs: the 20 most likely tokens of 512 at each position

# Max |heron logprob - HF logprob| allowed over the top-20 tokens at every position, per
# checkpoint (measured on this model: see the comments). HF's logits ("logits" in
# reference_logits.pt) simulate the checkpoint's activation quantization (compressed-tensors'
# QDQ) and, for GPTQ / AWQ, run gptqmodel's plain torch kernels, not the bf16 ones HF picks
# by default on CPU (1.3e-2 to 1.4e-2 from heron).
TOOL_CHECKPOINTS = {
    # compressed-tensors: heron and HF do the same arithmetic (dequantize to fp32, matmul
    # in fp32; the same fp8 rounding of activations): 0 to 2e-6 measured.
    "ct-fp8": 1e-4,
    "ct-fp8-dynamic": 1e-4,
    "ct-w4a16": 1e-4,
    "ct-w4a16-asym": 1e-4,
    "ct-w8a16": 1e-4,
    # W8A8 int8 with dynamic per-token activations: compressed-tensors' QDQ scales a token by
    # absmax / 127.5 (its range is [-128, 127]) and heron's int8 GEMM by absmax / 127, so the
    # activations round on two different grids, independent errors of the size of the
    # activation rounding itself: 4.5e-2 measured (heron vs HF without activation QDQ: 3.3e-2).
    "ct-w8a8": 8e-2,
    # GPTQModel's torch kernel rounds each dequantized weight (q - z) * s to the fp16 scale
    # dtype before the matmul; heron keeps it in fp32: 8e-4 to 1.1e-3 measured.
    "gptq-4bit-g32": 5e-3,
    "gptq-4bit-g32-asym": 5e-3,
    "gptq-8bit": 5e-3,
    "gptq-desc-act": 5e-3,
    # AWQ: gptqmodel's AWQ torch kernel casts fp32 activations to fp16 and matmuls in fp16,
    # so its error grows with the activations (and the scales AWQ searched): 1.6e-3 measured
    # with 16 calibration samples, 1.1e-2 with 32.
    "awq-gemm": 2e-2,
}

# heron quantize -> HF transformers: (heron quantize flags, tolerance as above)
HERON_CHECKPOINTS = {
    "heron-gptq": (["--method", "gptq", "--bits", "4", "--group-size", "32", "--act-order"], 5e-3),
    "heron-gptq8-asym": (["--method", "gptq", "--bits", "8", "--group-size", "64", "--no-sym"],
                         5e-3),
    "heron-awq": (["--method", "awq", "--group-size", "64"], 2e-2),
    "heron-w8a8": (["--method", "smoothquant", "--alpha", "0.5"], 8e-2),
    "heron-fp8": (["--method", "fp8"], 1e-4),
}


def _required() -> bool:
    return os.environ.get("HERON_REQUIRE_REFERENCE_TOOLS", "") not in ("", "0")


def _unavailable(reason: str):
    reason += " (`make reference-tools` builds .venv/peers/quant; HERON_REFERENCE_TOOLS_PYTHON " \
              "names another interpreter)"
    if _required():
        pytest.fail("HERON_REQUIRE_REFERENCE_TOOLS is set but " + reason, pytrace=False)
    pytest.skip(reason)


def _tool_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    return env


def _run_tool(python: Path, args: list[str], cwd: Path, timeout: int) -> str:
    try:
        p = subprocess.run([str(python), str(SCRIPT), *args], cwd=cwd, env=_tool_env(),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{SCRIPT.name} {' '.join(args)} ran past {timeout}s: "
                    f"{(e.stderr or b'')[-3000:]!r}", pytrace=False)
    if p.returncode != 0:
        pytest.fail(f"{SCRIPT.name} {' '.join(args)} exited {p.returncode}:\n"
                    f"{p.stderr[-6000:]}", pytrace=False)
    return p.stdout


@pytest.fixture(scope="module")
def tool_python() -> Path:
    env = os.environ.get("HERON_REFERENCE_TOOLS_PYTHON")
    py = Path(env) if env else DEFAULT_TOOL_PYTHON
    where = f"HERON_REFERENCE_TOOLS_PYTHON={env}" if env else str(DEFAULT_TOOL_PYTHON)
    if not (py.is_file() and os.access(py, os.X_OK)):
        _unavailable(f"no reference-tool interpreter at {where}")
    probe = ("import importlib.util, json, sys; "
             f"print(json.dumps([m for m in {list(TOOL_MODULES)!r} "
             "if importlib.util.find_spec(m) is None]))")
    p = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=120,
                       env=_tool_env())
    missing = json.loads(p.stdout) if p.returncode == 0 else TOOL_MODULES
    if missing:
        _unavailable(f"{where} lacks {', '.join(missing)}")
    return py


@pytest.fixture(scope="module")
def tool_checkpoints(tool_python, tmp_path_factory) -> tuple[Path, dict]:
    """The tools' checkpoints (+ HF reference logits) -> (root, summary.json)."""
    root = tmp_path_factory.mktemp("quant_reference")
    args = ["--out", str(root), "--calib-samples", str(CALIB_SAMPLES),
            "--timeout", str(CHILD_TIMEOUT_S), "--jobs", str(JOBS)]
    out = _run_tool(tool_python, args, root, TIMEOUT_S)
    return root, json.loads(out.strip().splitlines()[-1])  # also in root / "summary.json"


def _heron_logprobs(path: Path, input_ids: torch.Tensor):
    """heron's top-20 prompt logprobs and greedy next token for each row of ``input_ids``,
    and the quantization method it loaded the checkpoint with."""
    from heron import LLM, SamplingParams

    llm = LLM(str(path), num_kv_blocks=16, block_size=4, num_threads=1)
    try:
        ids = input_ids.tolist()
        outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP_K))
        method = llm.engine.core.executor.worker.quantization
    finally:
        llm.engine.shutdown()
    return outs, method


def _compare(outs, logits: torch.Tensor) -> dict:
    """heron's top-20 prompt logprobs against ``logits`` (HF's, [B, T, V]) -> max |Δ logprob|,
    and the positions where heron's most likely token (prompt logprobs, then the greedy token
    it generates after the prompt) is not HF's argmax although HF's top two are more than
    2 * Δ + 1e-5 apart (closer ones the format's own rounding may legitimately swap)."""
    lp = logits.float().log_softmax(-1)
    err = 0.0
    tops = []
    for b, out in enumerate(outs):
        assert len(out.prompt_logprobs) == lp.shape[1]
        for i in range(1, lp.shape[1]):
            pos = out.prompt_logprobs[i]
            assert len(pos) >= TOP_K
            for tok, v in pos.items():
                err = max(err, abs(v[0] - float(lp[b, i - 1, tok])))
            tops.append((b, i - 1, max(pos, key=lambda t: pos[t][0])))
        tops.append((b, lp.shape[1] - 1, out.outputs[0].token_ids[0]))
    checked, swapped = 0, []
    for b, i, heron_top in tops:
        top2 = lp[b, i].topk(2)
        if float(top2.values[0] - top2.values[1]) > 2 * err + 1e-5:
            checked += 1
            if heron_top != int(top2.indices[0]):
                swapped.append((b, i, heron_top, int(top2.indices[0])))
    return {"max_abs_dlogprob": err, "argmax_checked": checked, "argmax_swapped": swapped}


def _check(name: str, outs, ref: dict, tol: float) -> list[str]:
    """The failures of heron's ``outs`` against HF's ``ref`` (reference_logits.pt)."""
    res = _compare(outs, ref["logits"])
    bad = []
    if res["max_abs_dlogprob"] > tol:
        bad.append(f"{name}: max |dlogprob| {res['max_abs_dlogprob']:.3g} > {tol}")
    if res["argmax_swapped"]:
        bad.append(f"{name}: heron's argmax is not HF's at (row, pos, heron, HF) "
                   f"{res['argmax_swapped']}")
    positions = ref["input_ids"].numel()
    if res["argmax_checked"] < positions // 4:
        bad.append(f"{name}: only {res['argmax_checked']} of {positions} positions have a clear "
                   f"argmax")
    if "logits_weight_only" in ref:
        # Quantized activations: the W8A8 tolerance is not far below what rounding the
        # activations changes (3e-2 to 5e-2 on this model), so also check that heron rounds
        # them: it must differ from HF without activation QDQ about as much as HF with it does.
        wo = ref["logits_weight_only"]
        hf = float((ref["logits"].log_softmax(-1) - wo.log_softmax(-1)).abs().max())
        res["vs_weight_only"] = _compare(outs, wo)["max_abs_dlogprob"]
        if res["vs_weight_only"] < 0.25 * hf:
            bad.append(f"{name}: heron's logprobs are {res['vs_weight_only']:.3g} from HF's with "
                       f"unquantized activations, HF's own QDQ moves them {hf:.3g}: heron does "
                       f"not quantize the activations?")
    res["failures"] = bad
    return res


def _reference(path: Path) -> dict:
    return torch.load(path / "reference_logits.pt", weights_only=False)


def test_tools_wrote_every_checkpoint(tool_checkpoints):
    root, summary = tool_checkpoints
    assert set(summary["checkpoints"]) == {"fp32", *TOOL_CHECKPOINTS}, \
        "make_checkpoints.py's CHECKPOINTS and this test's table have drifted apart"


@pytest.mark.parametrize("name", list(TOOL_CHECKPOINTS))
def test_heron_matches_hf_on_tool_checkpoint(name, tool_checkpoints, record_property):
    root, summary = tool_checkpoints
    ent = summary["checkpoints"][name]
    assert ent.get("written"), f"{name}: the tool wrote no checkpoint: {ent.get('error')}"
    assert "ref_error" not in ent, f"{name}: HF transformers cannot load it: {ent['ref_error']}"
    if name == "awq-gemm":
        # AutoAWQ is deprecated upstream; only when it does not even import does GPTQModel's
        # AWQ GEMM exporter stand in (make_checkpoints.py records why in PRODUCER).
        producer = ent.get("producer", "")
        assert producer == "autoawq" or producer.startswith(
            "gptqmodel-awq (autoawq not importable"), producer
    ref = _reference(root / name)
    outs, method = _heron_logprobs(root / name, ref["input_ids"])
    expect = "compressed-tensors" if name.startswith("ct-") else name.split("-")[0]
    assert expect in method, method
    res = _check(name, outs, ref, TOOL_CHECKPOINTS[name])
    record_property("max_abs_dlogprob", res["max_abs_dlogprob"])
    print(f"{name}: max |dlogprob| {res['max_abs_dlogprob']:.3g} "
          f"({res['argmax_checked']} argmax checked)")
    assert not res["failures"], res["failures"]


def test_hf_matches_heron_on_heron_quantize_output(tool_python, tool_checkpoints, tmp_path):
    """``heron quantize`` writes each format from the tools' fp32 model; HF transformers (in the
    tools' venv: compressed-tensors, gptqmodel) loads each and matches heron's logits."""
    from heron.entrypoints.cli import main

    root, _ = tool_checkpoints
    src = root / "fp32"
    g = torch.Generator().manual_seed(7)
    words = torch.randint(3, 512, (4000,), generator=g).tolist()
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"t{w}" for w in words))  # the word-level tokenizer's "t<id>"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, (flags, _) in HERON_CHECKPOINTS.items():
            rc = main(["quantize", str(src), *flags, "--calib", str(calib), "--num-samples", "8",
                       "--seq-len", "64", "--out", str(tmp_path / name)])
            assert rc == 0, name
    finally:
        torch.set_num_threads(threads)
    dirs = [tmp_path / n for n in HERON_CHECKPOINTS]
    _run_tool(tool_python, ["--reference-dirs", ",".join(map(str, dirs))], tmp_path, 600)
    failures, measured = [], {}
    for name, (_, tol) in HERON_CHECKPOINTS.items():
        ref = _reference(tmp_path / name)
        outs, _method = _heron_logprobs(tmp_path / name, ref["input_ids"])
        res = _check(name, outs, ref, tol)
        measured[name] = (res["max_abs_dlogprob"], res["argmax_checked"])
        failures += res["failures"]
    print("heron quantize -> HF: max |dlogprob|", json.dumps(measured))
    assert not failures, failures


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
