"""A request owns its state: tokens, progress, blocks, sampling state, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from heron.outputs import PositionLogprobs
from heron.sampling_params import SamplingParams


@dataclass(eq=False)
class BlockTable:
    """A request's blocks in one KV cache group: block ``i`` holds positions
    ``[i * block_size, (i + 1) * block_size)``. A sliding-window group (or a StreamingLLM
    request) gives back the blocks that left its window, after the first ``head`` (its
    attention sinks, kept): ``block_ids[head:head + num_released]`` are no longer the
    request's (stale ids, which attention never reads). ``last_cached_node``: the group's
    prefix-tree node of block ``num_cached_blocks - 1`` of the request."""

    block_ids: list[int] = field(default_factory=list)
    num_released: int = 0
    head: int = 0
    last_cached_node: object | None = field(default=None, repr=False)

    def owned(self) -> list[int]:
        if not self.num_released:
            return self.block_ids
        return self.block_ids[:self.head] + self.block_ids[self.head + self.num_released:]

    def is_released(self, index: int) -> bool:
        return self.head <= index < self.head + self.num_released

    def clear(self) -> None:
        self.block_ids, self.num_released, self.last_cached_node = [], 0, None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # processing this request raised; the engine serves on

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Invariant: ``num_computed_tokens <= num_tokens``; the KV of tokens
    ``[0, num_computed_tokens)`` lives in its ``tables``, one per KV cache group (block ``i``
    of each holds positions ``[i * block_size, (i + 1) * block_size)``). A step that brings ``num_computed_tokens``
    up to ``num_tokens`` samples the next token.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    parent_id: str = ""  # the user-facing request this sequence belongs to
    index: int = 0  # which of the parent's n sequences
    max_tokens: int = 16  # resolved from params and max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    tables: list[BlockTable] = field(default_factory=lambda: [BlockTable()])
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    generator_seed: int | None = None  # the worker's generator for this sequence (if seeded)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    num_preemptions: int = 0
    # prefix cache: a salt isolates tenants; each table's block_ids[:num_cached_blocks] are in
    # its group's tree; num_cached_tokens is the hit at first admission
    cache_salt: str | None = None
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    num_overtakes: int = 0  # times a younger request was admitted first (policy fairness)
    scheduled_time: float | None = None  # first time the scheduler gave it tokens
    first_token_time: float | None = None
    finish_time: float | None = None
    # what the worker knows of it: described once, then sent only the blocks it lacks; its
    # tables hold block_ids[:num_blocks_sent] (0 after preemption; lowered when a computed
    # block is swapped for its cached twin)
    worker_knows: bool = False
    num_blocks_sent: int = 0
    num_output_sent: int = 0  # pipeline parallelism: output tokens the worker was sent
    # in a step that is still running (pipeline parallelism keeps several in flight): such a
    # request is not scheduled again, nor preempted, until that step's outcome is applied
    in_flight: bool = False
    # speculative decoding: tokens the worker drafted after this sequence's last step, to be
    # verified (as more tokens of the sequence) in its next one
    spec_token_ids: list[int] = field(default_factory=list)
    first_delta_sent: bool = False  # the first delta carries prompt info and metrics
    final_delta_sent: bool = False  # the delta that carries its finish went out

    def __post_init__(self) -> None:
        if self.generator_seed is None:
            self.generator_seed = self.params.seed
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def block_ids(self) -> list[int]:
        """The first group's table (the only one of a model whose layers are alike)."""
        return self.tables[0].block_ids

    @property
    def last_cached_node(self):
        return self.tables[0].last_cached_node

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end), without concatenating the whole sequence
        (a decode step needs one token, not a copy of its context)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt logprobs are still to be computed."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)
