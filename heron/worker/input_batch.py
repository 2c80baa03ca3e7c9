"""The worker's persistent batch state: every sequence it holds, kept across steps.

Each sequence owns one row of preallocated host arrays (its tokens and its block table), so
a step's flat batch is built by vectorised gathers over rows instead of Python lists rebuilt
from request objects. A row is taken when the core first sends the sequence and released when
the core says it finished or preempted it, so rows never outnumber the running sequences; a
preempted sequence keeps its state (tokens, seeded generator) and gets a row again when it
resumes. Updated only from ``step.SchedulerOutput`` and the tokens this worker sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from heron.sampling_params import SamplingParams
from heron.worker.batch import HostBatch
from heron.worker.step import CachedRequests, NewRequest, SchedulerOutput


@dataclass(eq=False)
class SequenceState:
    """What the sampler and the prompt-logprob pass read about one sequence."""

    req_id: str
    row: int  # -1 while preempted
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class InputBatch:
    """Rows of per-sequence state; row ``r`` is free or held by exactly one sequence.

    token_ids[r, :num_tokens[r]] are the sequence's tokens (prompt then outputs);
    block_table[g, r, :num_blocks[r]] its KV block ids in KV cache group ``g`` (the tables of
    all groups grow together).
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int,
                 num_groups: int = 1) -> None:
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        # np.zeros is calloc'd: rows and columns never touched cost no memory
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((num_groups, max_num_seqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.states: dict[str, SequenceState] = {}

    def __len__(self) -> int:
        return len(self.states)

    # ---- updates from the core -------------------------------------------------------------
    def update(self, sched: SchedulerOutput) -> None:
        """Apply a step's state changes (before running it)."""
        for req_id in sched.finished_req_ids:
            self._remove(req_id)
        for req_id in sched.preempted_req_ids:
            state = self.states.get(req_id)
            if state is not None and state.row >= 0:
                self.free_rows.append(state.row)
                state.row = -1
        for new in sched.new_requests:
            self._add(new)
        self._apply_cached(sched.cached)

    def _add(self, new: NewRequest) -> None:
        if new.req_id in self.states:
            raise ValueError(f"the worker already holds sequence {new.req_id!r}")
        generator = None
        if new.generator_seed is not None:
            generator = torch.Generator().manual_seed(new.generator_seed)
        state = SequenceState(new.req_id, -1, list(new.prompt_token_ids),
                              new.params, tuple(new.eos_token_ids), generator,
                              num_computed_tokens=new.num_computed_tokens)
        self._take_row(state)
        self._append_blocks(state.row, new.block_ids)
        self.states[new.req_id] = state

    def _take_row(self, state: SequenceState) -> None:
        """Give ``state`` a row holding its tokens and no blocks."""
        if not self.free_rows:
            raise RuntimeError("the worker's batch is full (more sequences than max_num_seqs)")
        state.row = row = self.free_rows.pop()
        tokens = state.all_token_ids()
        self.token_ids[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_blocks[row] = 0

    def _apply_cached(self, cached: CachedRequests) -> None:
        for req_id, kept, blocks, computed in zip(cached.req_ids, cached.num_kept_blocks,
                                                  cached.new_block_ids,
                                                  cached.num_computed_tokens):
            state = self.states[req_id]
            if state.row < 0:
                self._take_row(state)  # resumed after preemption
            self.num_blocks[state.row] = kept
            self._append_blocks(state.row, blocks)
            state.num_computed_tokens = computed
        for req_id, tokens in zip(cached.req_ids, cached.new_token_ids):
            self._append_tokens(self.states[req_id], tokens)

    def _append_blocks(self, row: int, blocks: list[list[int]]) -> None:
        """Append to each group's table (``blocks[g]``, all the same length)."""
        start = int(self.num_blocks[row])
        for table, group_blocks in zip(self.block_table, blocks):
            table[row, start:start + len(group_blocks)] = group_blocks
        self.num_blocks[row] = start + len(blocks[0])

    def _remove(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None and state.row >= 0:  # a preempted one holds no row
            self.free_rows.append(state.row)

    # ---- after a step ----------------------------------------------------------------------
    def advance(self, req_ids: list[str], num_tokens: list[int],
                sampled: list[list[int]]) -> None:
        """Record a successful step: progress, and the tokens sampled for each sequence."""
        for req_id, n, tokens in zip(req_ids, num_tokens, sampled):
            state = self.states[req_id]
            state.num_computed_tokens += n
            self._append_tokens(state, tokens)

    def _append_tokens(self, state: SequenceState, tokens: list[int]) -> None:
        if tokens:
            row, end = state.row, int(self.num_tokens[state.row])
            self.token_ids[row, end:end + len(tokens)] = tokens
            self.num_tokens[row] = end + len(tokens)
            state.output_token_ids.extend(tokens)

    def stage_drafts(self, spec_token_ids: dict[str, list[int]]) -> None:
        """Write each sequence's draft tokens right after its tokens, as scratch (its
        ``num_tokens`` does not move), so the step gathers them like any other input."""
        for req_id, drafts in spec_token_ids.items():
            row = self.states[req_id].row
            end = int(self.num_tokens[row])
            self.token_ids[row, end:end + len(drafts)] = drafts

    # ---- the flat batch of one step -------------------------------------------------------
    def host_batch(self, req_ids: list[str], num_tokens: list[int],
                   num_drafts: list[int] | None = None) -> HostBatch:
        """Sequence ``i`` computes ``num_tokens[i]`` tokens from its ``num_computed_tokens``,
        the last ``num_drafts[i]`` of them its staged draft tokens. A sequence that reaches
        its end samples: from its last row, or from each of its last ``1 + num_drafts[i]``
        rows when it verifies drafts (``sample_rows`` lists them in batch order)."""
        states = [self.states[r] for r in req_ids]
        rows = np.array([s.row for s in states], dtype=np.int64)  # (N,)
        query_lens = np.array(num_tokens, dtype=np.int64)  # (N,)
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)  # (N,)
        drafts = np.array(num_drafts or [0] * len(states), dtype=np.int64)  # (N,)
        end = self.num_tokens[rows] + drafts  # (N,) the tokens each sequence may compute
        if np.any(starts + query_lens > end):
            raise ValueError("a sequence is scheduled past the tokens the worker holds")
        host = self.batch_at(rows, starts, query_lens)
        host.sample_rows = [row for i, n in enumerate(drafts.tolist())
                            if host.seq_lens_cpu[i] == end[i]
                            for row in range(host.query_start_loc_cpu[i + 1] - 1 - n,
                                             host.query_start_loc_cpu[i + 1])]
        host.prompt_lp_rows = _prompt_logprob_rows(states, starts, query_lens,
                                                   host.query_start_loc_cpu)
        _mark_streaming(host, states, query_lens)
        return host

    def batch_at(self, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
                 token_offset: int = 0) -> HostBatch:
        """The flat batch where row ``rows[i]`` computes positions ``starts[i]`` ..
        ``starts[i] + query_lens[i] - 1``, reading the token ``token_offset`` positions
        later as each position's input (1: an EAGLE head's shifted inputs); no sampling
        rows. Also how a draft builds its catch-up batch."""
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)  # (N + 1,)
        np.cumsum(query_lens, out=query_start_loc[1:])
        # token t of sequence i sits at position starts[i] + (t - query_start_loc[i])
        req_of_token = np.repeat(np.arange(len(rows)), query_lens)  # (T,)
        positions = np.arange(query_start_loc[-1]) + np.repeat(starts - query_start_loc[:-1],
                                                               query_lens)
        input_ids = self.token_ids[rows[req_of_token], positions + token_offset]  # (T,)
        max_blocks = int(self.num_blocks[rows].max())
        block_tables = self.block_table[:, rows, :max_blocks]  # (G, N, max_blocks), 0-padded
        slots = (block_tables[:, req_of_token, positions // self.block_size] * self.block_size
                 + positions % self.block_size)  # (G, T)
        return HostBatch(
            torch.from_numpy(input_ids), torch.from_numpy(positions),
            torch.from_numpy(np.ascontiguousarray(slots)),
            torch.from_numpy(seq_lens), torch.from_numpy(query_start_loc),
            torch.from_numpy(np.ascontiguousarray(block_tables)), query_start_loc.tolist(),
            query_lens.tolist(), seq_lens.tolist(), [], {})


def _mark_streaming(host: HostBatch, states: list[SequenceState], query_lens: np.ndarray):
    """StreamingLLM sequences of the step: their (sinks, window), and where each of their
    queries sits in its cache (sinks + window - 1)."""
    streams = [s.params.streaming_kv for s in states]
    if not any(streams):
        return
    host.streaming = streams
    in_cache = np.array([sum(st) - 1 if st else -1 for st in streams], dtype=np.int64)
    per_token = np.repeat(in_cache, query_lens)  # (T,)
    host.sink_positions = torch.from_numpy(
        np.where(per_token >= 0, per_token, host.positions.numpy()))


def _prompt_logprob_rows(states, starts, query_lens, query_start_loc) -> dict[int, list[int]]:
    """Per batch index, the token rows whose next token is a prompt token to score: rows at
    positions p < num_prompt - 1 predict prompt token p + 1."""
    rows: dict[int, list[int]] = {}
    for i, s in enumerate(states):
        if s.params.prompt_logprobs is None:
            continue
        start = int(starts[i])
        last = min(start + int(query_lens[i]), s.num_prompt_tokens - 1)
        if last > start:
            first_row = int(query_start_loc[i])
            rows[i] = list(range(first_row, first_row + last - start))
    return rows
