"""Drafting after a step: the proposers of speculative decoding, on the worker's batch state.

After a step's outcome is recorded, the runner hands a ``StepView`` to its proposer, which
returns up to ``num_spec`` draft tokens per sequence that sampled; the core schedules them
as more tokens of that sequence in its next step, where ``rejection_sampler`` verifies them.

- ``NgramProposer``: prompt lookup over each sequence's tokens (``heron.spec.ngram``).
- ``ModelDrafter``: a draft model (``heron.spec.draft_models``) decoding greedily on the
  target's block tables. First a catch-up pass brings its KV up to the target's (every
  position the step computed; a layer-skip draft shares the target's KV and only feeds the
  new token) and drafts the first token from its last row; then ``num_spec - 1`` one-token
  passes. The KV it writes past the sequence lives in the step's lookahead slots (the
  scheduler allocates them) and is overwritten when the target verifies those positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from heron.attention import ForwardContext, forward_context
from heron.spec.ngram import propose_ngram
from heron.worker.batch import HostBatch, to_device
from heron.worker.input_batch import InputBatch, SequenceState


@dataclass
class StepView:
    """The step just run, after its outcome was recorded in the batch state."""

    states: list[SequenceState]  # the scheduled sequences, in batch order
    starts: list[int]  # their num_computed_tokens before the step
    proposing: list[int]  # indices of the sequences to draft for (they sampled)
    host: HostBatch  # the step's flat batch
    hidden: torch.Tensor  # (T, H): the target's final hidden states of the step
    num_spec: int  # drafts per sequence


class NgramProposer:
    catches_up = False  # keeps no state of its own

    def __init__(self, input_batch: InputBatch, min_n: int, max_n: int,
                 max_model_len: int) -> None:
        self.input_batch, self.min_n, self.max_n = input_batch, min_n, max_n
        self.max_model_len = max_model_len

    def propose(self, view: StepView) -> dict[str, list[int]]:
        ib, out = self.input_batch, {}
        for i in view.proposing:
            state = view.states[i]
            length = int(ib.num_tokens[state.row])
            k = min(view.num_spec, self.max_model_len - length - 1)
            if k > 0:
                drafts = propose_ngram(ib.token_ids[state.row, :length], k, self.min_n,
                                       self.max_n)
                if drafts:
                    out[state.req_id] = drafts
        return out


class ModelDrafter:
    """Runs a draft model with its own paged KV cache (or the target's) on the worker's
    block tables."""

    def __init__(self, draft, input_batch: InputBatch, target_kv_caches: list,
                 make_cache, backend, use_triton_ops: bool, device: torch.device,
                 max_model_len: int, tree=None) -> None:
        """``make_cache(num_kv_heads, head_dim)``: a zeroed per-layer cache of the target's
        pool shape (same blocks) for the draft's own layers. With a ``tree``
        (``heron.spec.tree.DraftTree``) it returns the tree's node tokens, read from its
        ranked choices along the greedy chain."""
        self.tree = tree
        self._width = tree.max_rank + 1 if tree is not None else 1
        self.draft, self.input_batch = draft, input_batch
        self.catches_up = draft.catches_up  # its KV follows every step, drafting or not
        layout = draft.kv_layout()
        if layout is None:
            self.kv_caches = target_kv_caches
        else:
            layers, kv_heads, head_dim = layout
            self.kv_caches = [make_cache(kv_heads, head_dim) for _ in range(layers)]
        self.backend, self.use_triton_ops = backend, use_triton_ops
        self.device, self.max_model_len = device, max_model_len

    def _forward(self, host: HostBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        tensors = to_device(host, self.device)
        md = host.metadata(tensors, self.input_batch.block_size)
        ctx = ForwardContext(md, self.kv_caches, self.backend, self.use_triton_ops)
        with forward_context(ctx):
            return self.draft.forward(tensors["input_ids"], tensors["positions"], hidden)

    def propose(self, view: StepView) -> dict[str, list[int]]:
        ib, offset = self.input_batch, self.draft.token_offset
        lengths = [int(ib.num_tokens[s.row]) for s in view.states]
        # draft only where the lookahead slots exist (the scheduler allocates them when the
        # pool has room): positions up to length + num_spec - 2 get KV
        bs = ib.block_size
        proposing = [i for i in view.proposing
                     if lengths[i] + view.num_spec < self.max_model_len and
                     ib.num_blocks[view.states[i].row] * bs >= lengths[i] + view.num_spec - 1]
        entries, drafting = self._catch_up_entries(view, lengths, set(proposing))
        if not entries:
            return {}
        rows, starts, lens = (np.array(col, dtype=np.int64) for col in zip(*entries))
        host = ib.batch_at(rows, starts, lens, offset)
        target_hidden = None
        if offset:  # the target's hidden state at each catch-up position (contiguous rows)
            target_hidden = torch.cat([view.hidden[r:r + n] for r, n in
                                       zip(self._hidden_rows(view, entries), lens.tolist())])
        hidden = self._forward(host, target_hidden)
        if not drafting:
            return {}  # caught up (prefill chunks, or speculation is off this step)
        last = [j for _, j in drafting]
        last_rows = [host.query_start_loc_cpu[j + 1] - 1 for j in last]
        hidden = hidden[last_rows]  # (S, H)
        ranked = self.draft.compute_logits(hidden).topk(self._width).indices  # (S, width)
        token, drafts = ranked[:, 0], [ranked]
        seq_rows = rows[last]
        positions = (starts + lens - 1)[last]  # (S,) last catch-up position
        for j in range(1, view.num_spec):
            # the input at position p + j is token p + j + offset: d_j, written as scratch
            ib.token_ids[seq_rows, positions + j + offset] = token.cpu().numpy()
            host = ib.batch_at(seq_rows, positions + j, np.ones_like(seq_rows), offset)
            hidden = self._forward(host, hidden)
            ranked = self.draft.compute_logits(hidden).topk(self._width).indices
            token = ranked[:, 0]
            drafts.append(ranked)
        choices = torch.stack(drafts, 1).tolist()  # (S, num_spec, width)
        if self.tree is None:
            tokens = [[r[0] for r in seq] for seq in choices]
        else:
            tokens = [self.tree.tokens_from_choices(seq) for seq in choices]
        return {view.states[i].req_id: t for (i, _), t in zip(drafting, tokens)}

    def _catch_up_entries(self, view: StepView, lengths: list[int], proposing: set[int]):
        """(row, start, length) of every sequence's catch-up positions, and (sequence index,
        entry index) of each sequence it drafts for. Position p is fed the token at
        p + offset, so an EAGLE head stops one position earlier."""
        entries, drafting = [], []
        for i, state in enumerate(view.states):
            if self.draft.catches_up:
                start = view.starts[i]
                end = state.num_computed_tokens
                if i in proposing and not self.draft.token_offset:
                    end += 1  # the new token too: its logits give the first draft
            elif i in proposing:
                start, end = lengths[i] - 1, lengths[i]
            else:
                continue
            if end > start:
                if i in proposing:
                    drafting.append((i, len(entries)))
                entries.append((state.row, start, end - start))
        return entries, drafting

    @staticmethod
    def _hidden_rows(view: StepView, entries) -> list[int]:
        """The step's flat row of each entry's first position."""
        by_row = {s.row: i for i, s in enumerate(view.states)}
        return [view.host.query_start_loc_cpu[by_row[row]] + start - view.starts[by_row[row]]
                for row, start, _ in entries]
