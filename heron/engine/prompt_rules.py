"""What a prompt must be for a model to take it: one set of rules, enforced by the engine core
(``EngineCore.add_request``) and checked first by the HTTP server (a 400 before any work).

Torch-free: the API process imports it.
"""

from __future__ import annotations

from heron.sampling_params import SamplingParams


class PromptError(ValueError):
    """A prompt (or parameters) this model cannot take; ``param`` names the request field
    at fault (``prompt`` or ``stop_token_ids``), as an OpenAI error body does."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _outside(ids: list[int], vocab_size: int) -> list[int]:
    """The first few ids outside [0, vocab_size) (min / max first: a long good prompt costs
    two passes in C, not one in Python)."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return []
    return [t for t in ids if not 0 <= t < vocab_size][:5]


def check_prompt(token_ids: list[int], params: SamplingParams, max_model_len: int,
                 vocab_size: int) -> int:
    """``PromptError`` (a ValueError) unless the model can take the prompt: not empty, at
    least one token of room left in ``max_model_len``, every token id and stop token id in
    the vocabulary. Returns that room: how many tokens the request can generate at most."""
    if not token_ids:
        raise PromptError("the prompt is empty", "prompt")
    room = max_model_len - len(token_ids)
    if room < 1:
        raise PromptError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                          f"{max_model_len}: no room to generate", "prompt")
    bad = _outside(token_ids, vocab_size)
    if bad:
        raise PromptError(f"token ids out of the vocabulary [0, {vocab_size}): {bad}", "prompt")
    bad = _outside(params.stop_token_ids, vocab_size)
    if bad:
        raise PromptError(f"stop_token_ids out of the vocabulary [0, {vocab_size}): {bad}",
                          "stop_token_ids")
    return room
