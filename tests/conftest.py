"""Fixtures every tier shares, and the tier markers.

The tiers are the folders under tests/ (unit, models, kernels, server, route, distributed,
reference_tools); each test is marked with its folder's name, so ``-m unit`` or
``-m "not models"`` selects by tier. Helpers shared by the test files live in tests/helpers/
(on sys.path through pytest's ``pythonpath`` setting) and import by bare name.

Session fixtures (the real SmolLM2 GGUF under heron and under HF transformers, the oracle) are
loaded once per session; module fixtures (tiny random models) once per test module. Tests must
not mutate any of them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

# Triton kernels run in its interpreter on a machine without a GPU. The variable must be set
# before any module defines a kernel (whichever test module imports one first, in whatever
# order the tiers are collected), so it is set here, before any heron import.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from heron.loader.gguf_loader import find_default_gguf  # noqa: E402

TIERS = ("unit", "models", "kernels", "server", "route", "distributed", "reference_tools")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier: the first folder under tests/ in its path."""
    root = Path(__file__).parent
    for item in items:
        parts = Path(item.fspath).relative_to(root).parts
        if len(parts) > 1 and parts[0] in TIERS:
            item.add_marker(parts[0])


@pytest.fixture(scope="session")
def gguf_path():
    return find_default_gguf()


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32").eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def smollm2():
    """heron's LLM on the embedded default model, with a small token budget so prompts chunk."""
    from heron import LLM

    return LLM(max_model_len=2048, max_num_batched_tokens=256, max_num_seqs=32)


class TinyModel(NamedTuple):
    """A tiny random HF checkpoint (``hf_reference.TINY_CONFIGS``, seed 0) on disk."""

    path: Path  # the checkpoint directory (config.json, safetensors)
    hf: Any  # the HF transformers model that wrote it (float32, eval): the oracle


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory) -> TinyModel:
    """A tiny random Llama (GQA, llama3 rope; vocabulary 512), one per module.

    Another architecture: ``@pytest.mark.parametrize("tiny", ["qwen2", ...], indirect=True)``.
    """
    from hf_reference import make_tiny_model

    arch = getattr(request, "param", "llama")
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    return TinyModel(path, make_tiny_model(arch, path))


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> str:
    """Directory of a tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template:
    a server or CLI on it starts in seconds and generates in milliseconds, one per module."""
    from server_fixture import make_tiny_served_model

    return str(make_tiny_served_model(tmp_path_factory.mktemp("tiny-served")))
