"""The triton attention backend (Triton CPU interpreter): same results as the torch backend on
one mixed step, and HF-exact greedy generation end to end with every fused kernel on."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton kernel is defined

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attention_steps import mixed_step  # noqa: E402
from hf_reference import TINY_CONFIGS, make_tiny_model, random_greedy_cases  # noqa: E402
from heron import LLM, SamplingParams  # noqa: E402
from heron.attention import get_attention_backend, resolve_backend_name  # noqa: E402
from heron.attention import triton_backend  # noqa: E402
from heron.kernels import reference  # noqa: E402

MAX_NEW = 6
PROMPT_LENS = (5, 23, 11)


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_backend_matches_torch_backend_on_amixed_step(sliding_window):
    q, k, v, kv_cache, md = mixed_step(sliding_window)
    torch_cache, triton_cache = kv_cache.clone(), kv_cache.clone()
    expected = get_attention_backend("torch").forward(q, k, v, torch_cache, md, 0.125,
                                                      sliding_window)
    md.backend_cache.clear()
    got = get_attention_backend("triton").forward(q, k, v, triton_cache, md, 0.125,
                                                  sliding_window)
    assert torch.equal(triton_cache, torch_cache)  # the same K/V stored in the same slots
    assert not torch.equal(triton_cache, kv_cache)
    assert reference.max_rel_error(got, expected) <= 1e-5


def test_backend_names(monkeypatch):
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"  # the C++ kernel builds
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    assert resolve_backend_name("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("flash", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        get_attention_backend("triton", "cpu")


def test_heron_runs_where_triton_is_absent(tmp_path):
    """With triton unimportable, "auto" picks the CPU kernels and never imports triton."""
    make_tiny_model("llama", tmp_path)
    code = f"""
import sys
sys.modules["triton"] = None  # any `import triton` now fails
from heron import LLM, SamplingParams
llm = LLM({str(tmp_path)!r}, attention_backend="auto")
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
assert len(out[0].outputs[0].token_ids) == 3
print(llm.engine.runner.backend.name)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "cpu"


@pytest.fixture(scope="module")
def cases(tiny):
    """Random prompts (seed 1) and HF's greedy continuations on the tiny model."""
    return random_greedy_cases(tiny.hf, PROMPT_LENS, MAX_NEW, seed=1)


def generate_and_compare(llm: LLM, prompts, refs) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    for out, (ref_tokens, ref_logprobs) in zip(llm.generate(prompts, params), refs):
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        for step, ref in enumerate(ref_logprobs):
            for token, lp in ref.items():
                assert got.logprobs[step][token][0] == pytest.approx(lp, abs=1e-4)


def _count_calls(monkeypatch, module, name: str, calls: dict) -> None:
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("tiny", sorted(TINY_CONFIGS), indirect=True)
def test_greedy_matches_hf_with_the_triton_backend(tiny, cases, monkeypatch):
    """Chunked prefill (budget 16, blocks of 4): steps mix decodes with prompt chunks whose
    prefix is already in the cache; RMSNorm, rotary and SiLU run as Triton kernels too."""
    from heron.kernels import activation, rmsnorm, rotary

    path, (prompts, refs) = tiny.path, cases
    calls: dict[str, int] = {}
    for module, name in ((rmsnorm, "rms_norm"), (rotary, "apply_rotary"),
                         (activation, "silu_and_mul")):
        _count_calls(monkeypatch, module, name, calls)
    plans = []
    make_plan = triton_backend._plan
    monkeypatch.setattr(triton_backend, "_plan", lambda md: plans.append(make_plan(md))
                        or plans[-1])
    llm = LLM(str(path), attention_backend="triton", max_num_batched_tokens=16, block_size=4)
    assert llm.engine.runner.backend.name == "triton"
    generate_and_compare(llm, prompts, refs)
    assert any(p.num_decodes and p.prefill_rows is not None for p in plans), "no mixed step"
    assert any(p.all_decode for p in plans)
    assert {"rms_norm", "apply_rotary", "silu_and_mul"} <= calls.keys()
