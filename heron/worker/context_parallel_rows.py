"""Context parallelism in the runner: a step's prefill rows split over the CP ranks
(``heron.attention.context_parallel_ring``), and the whole step's hidden states put back
together after the last layer, so sampling and prompt logprobs see every row."""

from __future__ import annotations

import torch

from heron.attention.context_parallel import CP_STATS
from heron.attention.context_parallel_ring import TokenSplit, split_tokens
from heron.attention.metadata import AttentionMetadata


def split_step(query_lens: list[int], query_starts: list[int], seq_lens: list[int], group,
               stripe: int) -> TokenSplit | None:
    """This rank's share of the step's rows, or None (every rank runs every row: no CP, or
    too few prefill rows to split)."""
    if group.world_size < 2:
        return None
    split = split_tokens(query_lens, query_starts, seq_lens, group.rank_in_group,
                         group.world_size, stripe)
    if split is not None:
        CP_STATS.split_prefill_tokens += split.prefill_local.numel()
    return split


def localize(split: TokenSplit, md: AttentionMetadata, input_ids: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mark ``md`` (and its KV cache groups' views) with ``split`` and narrow what is per
    token to this rank's rows: (input_ids, positions) of those rows. The rest of ``md``
    stays the whole step's (the attention backend needs it)."""
    rows = split.local_rows.to(input_ids.device)
    rope_lengths = None if md.rope_lengths is None else md.rope_lengths[rows]
    for view in md.group_views or [md]:
        view.cp_split = split
        view.rope_lengths = rope_lengths
    return input_ids[rows], positions[rows]


def gather_rows(hidden: torch.Tensor, split: TokenSplit, num_rows: int, group) -> torch.Tensor:
    """hidden (T_r, H), this rank's rows -> (num_rows, H), every row of the step (on every
    rank of the CP group): decode rows are this rank's own (every rank computed them), each
    rank's prefill rows come from it (one all-gather, padded to the longest share)."""
    counts = [rows.numel() for rows in split.prefill_rows]
    mine = hidden[split.prefill_local.to(hidden.device)]  # (P_r, H)
    padded = mine.new_zeros((max(counts), hidden.shape[1]))
    padded[:mine.shape[0]] = mine
    gathered = group.all_gather(padded)  # (N, max P, H)
    out = hidden.new_empty((num_rows, hidden.shape[1]))
    if split.decode_rows.numel():
        out[split.decode_rows.to(hidden.device)] = hidden[split.decode_local.to(hidden.device)]
    for s, rows in enumerate(split.prefill_rows):
        out[rows.to(hidden.device)] = gathered[s, :counts[s]]
    return out
