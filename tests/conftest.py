"""Shared fixtures: the real SmolLM2 GGUF under heron and under HF transformers (the oracle).

Each is loaded once per test session; tests must not mutate them.
"""

from __future__ import annotations

import pytest

from heron.loader.gguf_loader import find_default_gguf


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
