"""The flat batch of one step: built on the host from the worker's batch state
(``input_batch.InputBatch.host_batch``), then moved to the device in one copy (or staged into
a CUDA graph's static buffers, see ``cuda_graphs``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.attention import AttentionMetadata


@dataclass
class HostBatch:
    """Request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]``; all tensors are
    int64 on the CPU."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    slot_mapping: torch.Tensor  # (G, T): per KV cache group
    seq_lens: torch.Tensor  # (N,)
    query_start_loc: torch.Tensor  # (N + 1,)
    block_tables: torch.Tensor  # (G, N, max_blocks), padded with 0
    query_start_loc_cpu: list[int]
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    sample_rows: list[int]  # flat token index of the last token of each sampling request
    prompt_lp_rows: dict[int, list[int]]  # scheduled index -> token rows needing prompt logprobs
    # scheduled index -> (Q, Q) bool tree attention mask over its queries (speculative
    # decoding's tree verification; see AttentionMetadata.tree_masks)
    tree_masks: dict[int, torch.Tensor] | None = None
    # (T,) the sequence length each token's rotary embedding is for (length-dependent rope
    # scaling only; see AttentionMetadata.rope_lengths)
    rope_lengths: torch.Tensor | None = None
    # StreamingLLM requests of the step (see AttentionMetadata.streaming / sink_positions)
    streaming: list[tuple[int, int] | None] | None = None
    sink_positions: torch.Tensor | None = None  # (T,)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_cpu)

    def metadata(self, tensors: dict[str, torch.Tensor], block_size: int) -> AttentionMetadata:
        """The first KV cache group's metadata; with several groups, ``group_views`` holds
        each group's (the same step, its own slots and tables)."""
        device = tensors["positions"].device
        rope_lengths = None if self.rope_lengths is None else self.rope_lengths.to(device)
        sink_positions = None if self.sink_positions is None else self.sink_positions.to(device)
        views = [AttentionMetadata(
            slot_mapping=slots, block_tables=tables, seq_lens=tensors["seq_lens"],
            query_start_loc=tensors["query_start_loc"],
            query_start_loc_cpu=self.query_start_loc_cpu, query_lens_cpu=self.query_lens_cpu,
            seq_lens_cpu=self.seq_lens_cpu, block_size=block_size, tree_masks=self.tree_masks,
            rope_lengths=rope_lengths, streaming=self.streaming, sink_positions=sink_positions)
            for slots, tables in zip(tensors["slot_mapping"], tensors["block_tables"])]
        if len(views) > 1:
            views[0].group_views = views
        return views[0]


_DEVICE_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
                  "block_tables")


def to_device(host: HostBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch tensors on ``device``, in one host-to-device copy (views of one buffer)."""
    parts = [getattr(host, name) for name in _DEVICE_FIELDS]
    if device.type == "cpu":
        return dict(zip(_DEVICE_FIELDS, parts))
    flat = torch.cat([p.reshape(-1) for p in parts]).pin_memory()
    # non_blocking: torch's pinned-memory allocator keeps the source until the copy completes
    flat = flat.to(device, non_blocking=True)
    out, offset = {}, 0
    for name, part in zip(_DEVICE_FIELDS, parts):
        out[name] = flat[offset:offset + part.numel()].view(part.shape)
        offset += part.numel()
    return out
