"""The example plugin examples/heron-op-swiglu-limit (installed by ``make install``; installed
here if missing): discovered through its ``heron.ops`` entry point, passes ``heron
check-kernels`` (its C++ kernel against the float64 reference at 1e-3), and selected on a
model it changes the outputs exactly where its clamp bites, and nowhere else."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from op_plugin_steps import heron_model, prefill
from heron.kernels.plugins import discovery
from heron.layers.dispatch import apply_custom_ops

PLUGIN = Path(__file__).resolve().parents[2] / "examples" / "heron-op-swiglu-limit"


@pytest.fixture(scope="module")
def plugin():
    """The installed example's OpSpec (pip install -e --no-deps on first use)."""
    try:
        importlib.metadata.distribution("heron-op-swiglu-limit")
    except importlib.metadata.PackageNotFoundError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "-e", str(PLUGIN)], check=True)
        importlib.invalidate_caches()
    return discovery.refresh().get("swiglu_limit")


def test_discovered_from_its_distribution(plugin):
    assert plugin.source == "heron-op-swiglu-limit"
    assert plugin.slot == "activation:silu_and_mul" and plugin.backend == "cpp"


def test_check_kernels_passes_it():
    out = subprocess.run([sys.executable, "-m", "heron", "check-kernels", "--ops",
                          "swiglu_limit"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(r for r in out.stdout.splitlines() if r.startswith("swiglu_limit"))
    assert row.split()[2] == "float32" and row.endswith("ok")


@pytest.fixture(scope="module")
def models(tiny):
    """Two heron models of the tiny Llama with gate_up's output scaled x4 (a hook: the loader
    repacks the weights), so activations pass 7."""
    built = [heron_model(tiny.path) for _ in range(2)]
    for model in built:
        for mlp in (m for m in model.modules() if hasattr(m, "gate_up_proj")):
            mlp.gate_up_proj.register_forward_hook(lambda m, a, out: out * 4)
    return built


IDS = [3, 99, 410, 7, 256, 12, 64, 301, 5]


def test_changes_outputs_only_where_the_clamp_bites(plugin, models):
    selected, control = models
    acts = []
    hooks = [m.gate_up_proj.register_forward_hook(lambda m, a, out: acts.append(out.clone()))
             for m in selected.modules() if hasattr(m, "gate_up_proj")]
    before = prefill(selected, IDS)
    for h in hooks:
        h.remove()
    gate, up = torch.cat(acts).chunk(2, dim=-1)
    assert ((gate > 7) | (up.abs() > 7)).any()  # the clamp bites on this model
    assert torch.equal(prefill(selected, IDS), before)  # unselected: bit-identical re-run
    apply_custom_ops(selected, "swiglu_limit")
    after = prefill(selected, IDS)
    assert (after - before).abs().max() > 1e-3
    assert torch.equal(prefill(control, IDS), before)  # another model keeps its path
    # selected = the reference formula (float64, cast) in each MLP, within float32 rounding
    for mlp in (m for m in control.modules() if hasattr(m, "gate_up_proj")):
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(
            plugin.reference(mlp.gate_up_proj(x)).float())
    expected = prefill(control, IDS)
    assert (after - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_the_engine_applies_custom_ops_on_its_worker(plugin, tiny):
    """``LLM(custom_ops=...)`` (``--custom-ops``) reaches the worker that builds the model."""
    from heron import LLM, SamplingParams

    llm = LLM(tiny.path, custom_ops="swiglu_limit", num_kv_blocks=64)
    worker = llm.engine.core.executor.worker
    assert worker.custom_ops == {"activation:silu_and_mul": "swiglu_limit"}
    out = llm.generate([{"prompt_token_ids": IDS}], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="no_such_op"):
        LLM(tiny.path, custom_ops="no_such_op", num_kv_blocks=64)
