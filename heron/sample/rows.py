"""What the sampling functions read of a row: its parameters, its tokens and its generator."""

from __future__ import annotations

from typing import Protocol

import torch

from heron.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """One row of logits as the sampler sees it (the worker's ``SequenceState`` is one)."""

    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None  # on the CPU; None: the sampler's shared generator
    output_token_ids: list[int]  # what the presence / frequency penalties count

    @property
    def num_output_tokens(self) -> int: ...  # what min_tokens compares with

    def all_token_ids(self) -> list[int]: ...  # prompt and outputs: the repetition penalty's
