"""Loading a model's tokenizer (a leaf module: the API process and the engine both load one).

Nothing here imports torch or any heron package, so the torch-free API process can import it.
(Loading a tokenizer imports ``transformers``, which itself imports torch when it is
installed; importing this module does not.)
"""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(tokenizer_dir: str | Path | None):
    """The HF tokenizer saved in ``tokenizer_dir`` (None for models without one)."""
    if tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))
