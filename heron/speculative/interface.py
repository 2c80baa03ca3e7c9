"""The seam between the worker's runner and speculative decoding: what a proposer may read,
and what it returns.

The runner asks for its proposer once, at start (``factory.make_proposer(config, draft,
DraftContext(...))``): the context lends it the runner's batch state, KV caches and attention
backend. After each step the runner hands it a ``StepView`` and gets back drafts by request
id, which the core schedules as more tokens of those sequences in the next step. Which
verification that step needs the runner reads from the proposer (``Proposer.tree``).
A proposer sees nothing else of the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol, Sequence

import numpy as np
import torch

from heron.attention import AttentionMetadata
from heron.speculative.tree import DraftTree


class FlatBatch(Protocol):
    """A flat batch the runner built (``BatchState.batch_at``): sequence ``i`` owns rows
    ``query_start_loc_cpu[i]:query_start_loc_cpu[i + 1]``."""

    query_start_loc_cpu: list[int]


class BatchState(Protocol):
    """The worker's persistent batch state. Row ``r`` holds one sequence: its tokens are
    ``token_ids[r, :num_tokens[r]]`` (a proposer may write scratch tokens past them; the
    next step overwrites those), it owns ``num_blocks[r]`` KV blocks of ``block_size``."""

    block_size: int
    token_ids: np.ndarray  # (max_num_seqs, max_model_len) int64
    num_tokens: np.ndarray  # (max_num_seqs,) int64
    num_blocks: np.ndarray  # (max_num_seqs,) int64

    def batch_at(self, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
                 token_offset: int = 0) -> FlatBatch:
        """Row ``rows[i]`` computes positions ``starts[i]`` .. ``starts[i] + query_lens[i]
        - 1``, each fed the token ``token_offset`` positions later."""
        ...


class StepSequence(Protocol):
    """One scheduled sequence, after the step's outcome was recorded."""

    req_id: str
    row: int  # its row of the ``BatchState``
    num_computed_tokens: int


@dataclass
class StepView:
    """The step just run, after its outcome was recorded in the batch state."""

    seqs: Sequence[StepSequence]  # the scheduled sequences, in batch order
    starts: list[int]  # their num_computed_tokens before the step
    proposing: list[int]  # indices of the sequences to draft for ([]: only catch up)
    query_start_loc: list[int]  # (N + 1,): sequence i's rows of ``hidden`` start here
    hidden: torch.Tensor  # (T, H): the target's final hidden states of the step
    num_spec: int  # drafts per sequence


@dataclass(frozen=True)
class DraftContext:
    """What the runner lends its proposer, once."""

    batch: BatchState
    # a flat batch -> (input_ids (T,), positions (T,), attention metadata), on the device
    device_inputs: Callable[[FlatBatch], tuple[torch.Tensor, torch.Tensor,
                                               AttentionMetadata]]
    # (metadata, per-layer KV caches) -> a ``with`` block in which model code attends
    # through the runner's backend over those caches
    forward_context: Callable[[AttentionMetadata, list], ContextManager]
    target_kv_caches: list[torch.Tensor | None]  # the target's (a layer-skip draft shares)
    # (num_kv_heads, head_dim) -> one zeroed layer cache over the target's blocks
    make_cache: Callable[[int, int], torch.Tensor]
    device: torch.device
    max_model_len: int


class Proposer(Protocol):
    """Drafts tokens after a step."""

    catches_up: bool  # runs after every step (its KV follows the target's), drafting or not
    tree: DraftTree | None  # its drafts are this tree's nodes; None: one chain

    def propose(self, view: StepView) -> dict[str, list[int]]:
        """Up to ``view.num_spec`` draft tokens (a tree: its nodes' tokens) per proposing
        sequence, by request id; a sequence may get none."""
        ...
