"""The `heron` command line as a user meets it: help text, clean stdout, progress on stderr,
one-line errors, speculative decoding figures, and `heron chat` driven through a pty."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from heron.entrypoints.cli import build_parser

TIMEOUT = 300


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HERON_LOGGING_LEVEL"}
    return {**env, **extra}


def heron(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heron", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env(), stdin=subprocess.DEVNULL)


def _subparsers(parser: argparse.ArgumentParser, prefix: str = ""):
    """(name, parser) of every subcommand, nested ones (bench serve) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + name, sub
                yield from _subparsers(sub, prefix + name + " ")


ALL = dict(_subparsers(build_parser()))
OWN = ("generate", "chat", "serve")


@pytest.mark.parametrize("name", sorted(ALL))
def test_no_option_states_its_default_twice(name):
    parser = ALL[name]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS):
            continue
        text = formatter._expand_help(action).lower()
        assert len(re.findall(r"\(default|default:", text)) <= 1, \
            f"heron {name} {action.option_strings}: {text!r}"


@pytest.mark.parametrize("name", OWN)
def test_every_option_says_what_it_does(name):
    for action in ALL[name]._actions:
        assert action.help, f"heron {name} {action.option_strings} has no help text"


def test_multi_node_flags_only_on_serve():
    for name in ("generate", "chat"):
        assert "--nnodes" not in ALL[name].format_help()
        assert "--master-addr" not in ALL[name].format_help()
    assert "--nnodes" in ALL["serve"].format_help()


def test_sampling_flags_show_their_defaults():
    parser = ALL["generate"]
    helps = {a.option_strings[-1]: parser._get_formatter()._expand_help(a)
             for a in parser._actions if a.option_strings}
    for flag, default in (("--top-p", "1.0"), ("--top-k", "0"), ("--max-tokens", "256"),
                          ("--temperature", "0.0"), ("--dtype", "float32")):
        assert helps[flag].endswith(f"(default: {default})"), helps[flag]


# ---- runs on a tiny random model (SmolLM2's tokenizer and chat template): served_model ----


def test_generate_stdout_is_the_completion_alone_and_progress_goes_to_stderr(served_model):
    from heron import LLM, SamplingParams

    prompt = "The capital of France is"
    proc = heron("generate", prompt, "--model", served_model, "--max-tokens", "8", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr[-2000:]
    llm = LLM(served_model)
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    llm.engine.shutdown()
    assert proc.stdout == want.outputs[0].text + "\n"
    for phase in ("model config", "weights", "KV cache sizing", "tokenizer"):
        assert f"INFO heron." in proc.stderr and f"startup: {phase} took" in proc.stderr
    assert "torch threads: " in proc.stderr
    assert "\r" not in proc.stderr  # no progress bars off a terminal


def test_quiet_leaves_stderr_empty(served_model):
    proc = heron("generate", "Hi", "--model", served_model, "--max-tokens", "2", "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == "" and proc.stdout.strip()


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_bad_model_path_is_one_line(command):
    args = [command] + (["Hi"] if command == "generate" else []) + ["--model", "/nonexistent/m"]
    if command == "serve":
        args += ["--port", "0"]
    proc = heron(*args)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("heron: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors == ["heron: error: model '/nonexistent/m' not found: pass a Hugging Face "
                      "model directory or a .gguf file (no model hub is contacted)"]
    assert "Traceback" not in proc.stderr and lines[-1] == errors[0]


def test_verbose_error_has_the_traceback():
    proc = heron("generate", "Hi", "--model", "/nonexistent/m", "-v")
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert "FileNotFoundError" in proc.stderr


def test_generate_prints_speculative_decoding_figures(served_model):
    """The model drafting for itself: greedy drafts are (nearly) all accepted."""
    spec = json.dumps({"method": "draft", "model": served_model, "num_speculative_tokens": 2})
    proc = heron("generate", "one two three", "--model", served_model, "--max-tokens", "24",
                 "--ignore-eos", "--speculative-config", spec)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r"acceptance rate ([\d.]+)%, mean acceptance length ([\d.]+) \(drafts "
                      r"(\d+), draft tokens (\d+), accepted (\d+)", proc.stderr)
    assert found, proc.stderr[-2000:]
    rate, mean_len = float(found[1]), float(found[2])
    drafts, draft_tokens, accepted = int(found[3]), int(found[4]), int(found[5])
    assert 0 < drafts <= draft_tokens <= 2 * drafts and accepted >= 0.9 * draft_tokens
    assert rate == pytest.approx(100 * accepted / draft_tokens, abs=0.05)
    assert mean_len == pytest.approx(1 + accepted / drafts, abs=0.005)
    assert "speculative" not in proc.stdout


def test_thread_default_leaves_a_core_for_the_rest():
    from heron.config import default_cpu_threads

    assert default_cpu_threads(1, cores=2)[0] == 1
    assert default_cpu_threads(1, cores=16)[0] == 15
    assert default_cpu_threads(2, cores=16)[0] == 7
    assert default_cpu_threads(4, cores=2)[0] == 1  # never zero
    assert "--threads" in default_cpu_threads(1, cores=8)[1]
