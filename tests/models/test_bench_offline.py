"""`heron bench throughput | latency` end to end on tiny random models, `--load-format dummy`,
and the offline path importing without the server's dependencies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from heron import LLM, SamplingParams
from heron.bench import roofline
from heron.bench.cli import main as bench_main


@pytest.fixture(scope="module")
def config_only_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("config-only")
    shutil.copy(tiny.path / "config.json", path / "config.json")
    return path


def test_dummy_load_format_needs_only_config(config_only_dir):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(config_only_dir))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for _ in range(2):
        llm = LLM(str(config_only_dir), load_format="dummy", seed=3, num_kv_blocks=16)
        model = llm.engine.runner.model
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
        assert model.model.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(
            0.02, rel=0.2)
        outs.append(llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids)
    assert len(outs[0]) == 6 and outs[0] == outs[1]  # same seed, same random weights
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(config_only_dir), load_format="random")


def test_throughput_with_hf_peer(tiny, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    rc = bench_main(["throughput", "--model", str(tiny.path), "--num-prompts", "5",
                     "--input-len", "6:20", "--output-len", "3:9", "--peer", "hf",
                     "--json-out", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    heron, hf = record["results"]["heron"], record["results"]["hf"]
    assert heron["output_tokens"] == hf["output_tokens"] >= 15
    assert heron["input_tokens"] == hf["input_tokens"]
    assert record["ratios"]["output_tok_s"] == pytest.approx(
        heron["output_tok_s"] / hf["output_tok_s"])
    assert record["identical_frac"] == 1.0  # same weights, greedy: HF-exact
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1])["kind"] == "throughput"
    assert any(line.startswith("output_tok_s") for line in printed)


def test_latency_with_roofline_on_cpu(tiny, tmp_path):
    out = tmp_path / "latency.json"
    rc = bench_main(["latency", "--model", str(tiny.path), "--batch-sizes", "1,3",
                     "--input-len", "12", "--output-len", "5", "--iters", "1",
                     "--roofline", "on", "--json-out", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    rows = record["results"]["heron"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["prefill_tok_s"] == pytest.approx(r["batch_size"] * 12 / r["prefill_s"])
        assert r["decode_tok_s"] == pytest.approx(r["batch_size"] * 4 / r["decode_s"])
        # below the ceiling, or the roofline arithmetic is wrong
        assert 0 < r["prefill_roofline_frac"] < 1 and 0 < r["decode_roofline_frac"] < 1
    assert record["roofline"]["copy_gb_s"] > 0 and record["roofline"]["gemm_tflop_s"] > 0


def test_roofline_work_counts(tiny):
    llm = LLM(str(tiny.path), num_kv_blocks=8)
    model = llm.engine.runner.model
    # tiny llama: hidden 64, 4 heads x 16, 2 KV heads, intermediate 128, 2 layers, vocab 512
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    assert roofline.projection_params(model) == (2 * per_layer, 512 * 64)
    norms = (2 * 2 + 1) * 64
    untied = 4 * (2 * per_layer + 512 * 64 + norms)  # float32; input embedding not streamed
    assert roofline.weight_bytes(model) == untied
    assert roofline.prefill_flops(10, 3, 2, 8, batch=2, input_len=4) == (
        2 * 10 * 8 + 2 * 3 * 2 + 2 * 2 * 8 * 2 * 4 * 5)
    assert roofline.decode_step_bytes(1000, 10, batch=2, context=7) == 1000 + 2 * 8 * 10


def test_bad_flags_give_clear_errors(tiny, capsys):
    assert bench_main(["latency", "--model", str(tiny.path), "--batch-sizes", "0"]) == 2
    assert "batch sizes must be >= 1" in capsys.readouterr().err
    assert bench_main(["throughput", "--model", str(tiny.path), "--input-len", "9:3"]) == 2
    assert "MIN <= MAX" in capsys.readouterr().err


BLOCKER = textwrap.dedent("""
    import sys
    # msgspec is not here: the engine's step boundary is msgspec data, also in-process
    BLOCKED = {"fastapi", "starlette", "uvicorn", "zmq", "gguf", "prometheus_client",
               "matplotlib"}

    class Blocker:  # behaves as if these packages were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    from heron import LLM
    import heron.bench.throughput
    from heron.entrypoints.cli import main
    rc = main(["bench", "throughput", "--model", sys.argv[1], "--load-format", "dummy",
               "--num-prompts", "3", "--input-len", "8", "--output-len", "4"])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("RESULT", rc, loaded)
""")


def test_offline_path_runs_without_server_dependencies(config_only_dir):
    proc = subprocess.run([sys.executable, "-c", BLOCKER, str(config_only_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT 0 []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
