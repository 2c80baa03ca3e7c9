"""heron.kernels.plugins and --custom-ops, on fake plugins (torch ops, no compiler): discovery
through the ``heron.ops`` entry points, the precision gate's verdicts (a plugin that does not
import, raises or is wrong is a row saying so; check-kernels carries on and exits 1), and the
selection: it changes a model's outputs only in the slot selected and only in that model."""

from __future__ import annotations

import torch
import pytest

from op_plugin_steps import fake_entry_point, heron_model, prefill
from heron.config import EngineConfig, parse_custom_ops
from heron.entrypoints.check_kernels import run as check_kernels
from heron.entrypoints.cli import build_parser
from heron.kernels.plugins import OpSpec, builtin, discovery as registry_module
from heron.kernels.plugins.gate import check_registry
from heron.kernels.reference import rms_norm as rms_norm_ref, silu_and_mul as silu_ref
from heron.layers.dispatch import apply_custom_ops


def clamped_silu(limit: float):
    def kernel(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return torch.nn.functional.silu(gate) * up
    return kernel


def clamped_ref(limit: float):
    return lambda gate_up: clamped_silu(limit)(gate_up.double())


def act_cases(device):
    yield (torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 4,)


def norm_cases(device):
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    yield x, torch.ones(16), 1e-6, None


def boom(*args):
    raise RuntimeError("kernel exploded")


CLAMP = OpSpec("clamp2", "activation:silu_and_mul", clamped_silu(2.0), clamped_ref(2.0),
               act_cases)
WRONG = OpSpec("wrong_norm", "norm:rms_norm", lambda x, w, eps, r: 2 * x, rms_norm_ref,
               norm_cases)
RAISES = OpSpec("raises", "activation:silu_and_mul", boom, silu_ref, act_cases)


@pytest.fixture
def plugins(monkeypatch):
    """Install fake entry points (and no built-ins, which need the C++ build): a callable
    returning the good op, a wrong one, a raising one, a module that does not import, an
    object of the wrong type and a duplicate name."""
    eps = [fake_entry_point("clamp2", lambda: CLAMP, "clamp-plugin"),
           fake_entry_point("wrong_norm", [WRONG], "wrong-plugin"),
           fake_entry_point("raises", RAISES, "raising-plugin"),
           fake_entry_point("missing", ModuleNotFoundError("No module named 'nope'"),
                            "missing-plugin"),
           fake_entry_point("not_a_spec", {"name": "x"}, "typed-plugin"),
           fake_entry_point("clamp2_again", CLAMP, "dup-plugin")]
    monkeypatch.setattr(registry_module, "entry_points", lambda: eps)
    monkeypatch.setattr(builtin, "builtin_ops", lambda: [])
    registry_module.registry.cache_clear()
    yield registry_module.registry()
    registry_module.registry.cache_clear()


def test_discovery_keeps_good_ops_and_names_each_broken_plugin(plugins):
    assert list(plugins.ops) == ["clamp2", "wrong_norm", "raises"]
    assert plugins.ops["clamp2"].source == "clamp-plugin"
    reasons = {e.name: e.reason for e in plugins.errors}
    assert set(reasons) == {"missing", "not_a_spec", "clamp2_again"}
    assert reasons["missing"].startswith("ModuleNotFoundError: No module named 'nope'")
    assert "expected an OpSpec" in reasons["not_a_spec"]
    assert "taken (by clamp-plugin)" in reasons["clamp2_again"]
    with pytest.raises(ValueError, match="failed to load.*ModuleNotFoundError"):
        plugins.get("missing")


def test_gate_verdicts(plugins):
    rows = {c.op: c for c in check_registry(plugins, "cpu")}
    assert rows["clamp2"].status == "ok" and rows["clamp2"].max_rel_error < 1e-6
    assert rows["wrong_norm"].status == "FAIL" and rows["wrong_norm"].max_rel_error > 0.1
    assert rows["raises"].status == "ERROR" and "kernel exploded" in rows["raises"].reason
    assert rows["missing"].status == "ERROR" and "failed to load" in rows["missing"].reason


def test_check_kernels_reports_every_row_and_exits_1(plugins, capsys):
    args = build_parser().parse_args(["check-kernels", "--ops", "all"])
    assert check_kernels(args) == 1
    out = capsys.readouterr().out
    assert "clamp2" in out and " ok" in out
    for line in ("wrong_norm", "raises", "missing", "not_a_spec"):
        assert any(line in row and ("FAIL" in row or "ERROR" in row)
                   for row in out.splitlines()), line
    assert "1/6 within tolerance" in out
    args = build_parser().parse_args(["check-kernels", "--ops", "clamp2"])
    assert check_kernels(args) == 0


def test_fake_dist_info_on_sys_path_is_discovered(tmp_path, monkeypatch):
    """A real (if broken) installed plugin: a dist-info with a ``heron.ops`` entry point whose
    module does not exist."""
    info = tmp_path / "broken_op-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-op\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[heron.ops]\nbroken = broken_op_missing:ops\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(builtin, "builtin_ops", lambda: [])
    registry_module.registry.cache_clear()
    try:
        errors = registry_module.registry().errors
        broken = [e for e in errors if e.name == "broken"]
        assert broken and broken[0].source == "broken-op"
        assert "No module named 'broken_op_missing'" in broken[0].reason
    finally:
        registry_module.registry.cache_clear()


def test_custom_ops_flag_and_config():
    assert parse_custom_ops("+a, b") == ("a", "b")
    assert EngineConfig(custom_ops="x,y").custom_ops == ("x", "y")
    assert EngineConfig().custom_ops == ()
    for bad in ("-rms_norm", "a,a", "all"):
        with pytest.raises(ValueError):
            parse_custom_ops(bad)
    args = build_parser().parse_args(["generate", "hi", "--custom-ops", "swiglu_limit"])
    assert args.custom_ops == "swiglu_limit"


@pytest.fixture(scope="module")
def models(tiny):
    """Three heron models of the tiny Llama: to select on, and two controls."""
    return [heron_model(tiny.path) for _ in range(3)]


IDS = [5, 17, 300, 42, 9, 88, 1, 250, 7, 33, 71]


def test_selection_changes_only_its_slot_and_only_its_model(plugins, models):
    selected, control, scaled = models
    before = prefill(control, IDS)
    unclamped = prefill(selected, IDS)
    norms_in = []
    hook = selected.model.layers[0].input_layernorm.register_forward_hook(
        lambda m, a, out: norms_in.append(out.clone()))
    plain_norm = (prefill(selected, IDS), norms_in.pop())[1]
    assert apply_custom_ops(selected, "clamp2") == {"activation:silu_and_mul": "clamp2"}
    clamped = prefill(selected, IDS)
    hook.remove()
    assert torch.equal(norms_in.pop(), plain_norm)  # the norm slot is untouched, bit for bit
    assert (clamped - unclamped).abs().max() > 1e-2  # the clamp bites
    assert torch.equal(prefill(control, IDS), before)  # another model: bit-identical
    # what the selection computes: the op's formula in each MLP, written out by hand
    for mlp in (m for m in scaled.modules() if hasattr(m, "gate_up_proj")):
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(clamped_silu(2.0)(mlp.gate_up_proj(x)))
    assert torch.equal(prefill(scaled, IDS), clamped)


def test_selection_errors(plugins, models):
    model = models[2]
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        apply_custom_ops(model, "nope")
    with pytest.raises(ValueError, match="both plug into activation:silu_and_mul"):
        apply_custom_ops(model, "clamp2,raises")
    with pytest.raises(ValueError, match="checked for float32, not bfloat16"):
        apply_custom_ops(model, "clamp2", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="runs on cpu, not on cuda"):
        apply_custom_ops(model, "clamp2", "cuda")
