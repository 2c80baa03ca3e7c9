"""A draft model proposing tokens on the target's block tables (``ModelDrafter``).

The draft (``draft_models``) decodes greedily: first a catch-up pass brings its KV up to the
target's (every position the step computed; a layer-skip draft shares the target's KV and
only feeds the new token) and drafts the first token from its last row; then
``num_spec - 1`` one-token passes. The KV it writes past the sequence lives in the step's
lookahead slots (the scheduler allocates them) and is overwritten when the target verifies
those positions. With a ``DraftTree`` it returns the tree's node tokens, read from its
ranked choices along the greedy chain.
"""

from __future__ import annotations

import numpy as np
import torch

from heron.speculative.interface import DraftContext, FlatBatch, StepView
from heron.speculative.tree import DraftTree


class ModelDrafter:
    """Runs a draft model with its own paged KV cache (or the target's) on the runner's
    block tables, through what ``DraftContext`` lends it."""

    def __init__(self, draft, ctx: DraftContext, tree: DraftTree | None = None) -> None:
        self.draft, self.ctx, self.tree = draft, ctx, tree
        self._width = tree.max_rank + 1 if tree is not None else 1
        self.catches_up = draft.catches_up  # its KV follows every step, drafting or not
        layout = draft.kv_layout()
        if layout is None:
            self.kv_caches = ctx.target_kv_caches
        else:
            layers, kv_heads, head_dim = layout
            self.kv_caches = [ctx.make_cache(kv_heads, head_dim) for _ in range(layers)]

    def _forward(self, flat: FlatBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        input_ids, positions, md = self.ctx.device_inputs(flat)
        with self.ctx.forward_context(md, self.kv_caches):
            return self.draft.forward(input_ids, positions, hidden)

    def propose(self, view: StepView) -> dict[str, list[int]]:
        batch, offset = self.ctx.batch, self.draft.token_offset
        lengths = [int(batch.num_tokens[s.row]) for s in view.seqs]
        # draft only where the lookahead slots exist (the scheduler allocates them when the
        # pool has room): positions up to length + num_spec - 2 get KV
        bs = batch.block_size
        proposing = [i for i in view.proposing
                     if lengths[i] + view.num_spec < self.ctx.max_model_len and
                     batch.num_blocks[view.seqs[i].row] * bs >= lengths[i] + view.num_spec - 1]
        entries, drafting = self._catch_up_entries(view, lengths, set(proposing))
        if not entries:
            return {}
        rows, starts, lens = (np.array(col, dtype=np.int64) for col in zip(*entries))
        flat = batch.batch_at(rows, starts, lens, offset)
        target_hidden = None
        if offset:  # the target's hidden state at each catch-up position (contiguous rows)
            target_hidden = torch.cat([view.hidden[r:r + n] for r, n in
                                       zip(self._hidden_rows(view, entries), lens.tolist())])
        hidden = self._forward(flat, target_hidden)
        if not drafting:
            return {}  # caught up (prefill chunks, or speculation is off this step)
        last = [j for _, j in drafting]
        last_rows = [flat.query_start_loc_cpu[j + 1] - 1 for j in last]
        choices = self._decode(hidden[last_rows], rows[last], (starts + lens - 1)[last],
                               view.num_spec)
        if self.tree is None:
            tokens = [[r[0] for r in seq] for seq in choices]
        else:
            tokens = [self.tree.tokens_from_choices(seq) for seq in choices]
        return {view.seqs[i].req_id: t for (i, _), t in zip(drafting, tokens)}

    def _decode(self, hidden: torch.Tensor, seq_rows: np.ndarray, positions: np.ndarray,
                num_spec: int) -> list:
        """hidden (S, H): the draft's state at each drafting sequence's last catch-up
        position (``positions``, (S,)) -> its ranked choices (S, num_spec, width) as lists,
        decoding greedily one position at a time."""
        batch, offset = self.ctx.batch, self.draft.token_offset
        ranked = self.draft.compute_logits(hidden).topk(self._width).indices  # (S, width)
        token, drafts = ranked[:, 0], [ranked]
        for j in range(1, num_spec):
            # the input at position p + j is token p + j + offset: d_j, written as scratch
            batch.token_ids[seq_rows, positions + j + offset] = token.cpu().numpy()
            flat = batch.batch_at(seq_rows, positions + j, np.ones_like(seq_rows), offset)
            hidden = self._forward(flat, hidden)
            ranked = self.draft.compute_logits(hidden).topk(self._width).indices
            token = ranked[:, 0]
            drafts.append(ranked)
        return torch.stack(drafts, 1).tolist()  # (S, num_spec, width)

    def _catch_up_entries(self, view: StepView, lengths: list[int], proposing: set[int]):
        """(row, start, length) of every sequence's catch-up positions, and (sequence index,
        entry index) of each sequence it drafts for. Position p is fed the token at
        p + offset, so an EAGLE head stops one position earlier."""
        entries, drafting = [], []
        for i, seq in enumerate(view.seqs):
            if self.draft.catches_up:
                start = view.starts[i]
                end = seq.num_computed_tokens
                if i in proposing and not self.draft.token_offset:
                    end += 1  # the new token too: its logits give the first draft
            elif i in proposing:
                start, end = lengths[i] - 1, lengths[i]
            else:
                continue
            if end > start:
                if i in proposing:
                    drafting.append((i, len(entries)))
                entries.append((seq.row, start, end - start))
        return entries, drafting

    @staticmethod
    def _hidden_rows(view: StepView, entries) -> list[int]:
        """The step's flat row of each entry's first position."""
        by_row = {s.row: i for i, s in enumerate(view.seqs)}
        return [view.query_start_loc[by_row[row]] + start - view.starts[by_row[row]]
                for row, start, _ in entries]
