"""Token embedding and the LM head (which may share the embedding's weight), split by
vocabulary across the tensor-parallel ranks.

The vocabulary is padded to a multiple of the TP size; rank r holds rows
[r * V / tp, (r + 1) * V / tp) of the (padded) table, zero past the real vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.distributed import get_tp_group
from heron.layers.cpu_gemm import CpuGemm
from heron.layers.linear import default_weight_loader
from heron.quant.gguf_blocks import QuantizedRows
from heron.quant.int_layout import GroupedIntWeight, quant_linear, unpack_values


class VocabParallelEmbedding(nn.Module):
    """(T,) token ids -> (T, hidden): each rank looks up the ids in its range (zero for the
    others), and the ranks' rows are all-reduced."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.vocab_size = vocab_size
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        # real rows of this shard (the last shard may be partly padding)
        self.num_real_rows = max(0, min(vocab_size - self.vocab_start, self.shard_size))
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size),
                                   requires_grad=False)
        # a GGUF table kept quantized (the weight is then empty); shared with a tied LM head
        self.quantized: GroupedIntWeight | None = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) local row ids -> (T, hidden) rows of the table, float or dequantized."""
        if self.quantized is None:
            return F.embedding(ids, self.weight)
        w = self.quantized
        q = unpack_values(w.qweight[ids], w.bits, w.in_features).to(torch.float32)
        q = q.view(ids.shape[0], -1, w.group_size)  # (T, groups, group_size)
        rows = q * w.scales[ids].unsqueeze(-1) + w.mins[ids].unsqueeze(-1)
        return rows.view(ids.shape[0], w.in_features).to(self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        hidden = self._lookup(local.masked_fill(outside, 0))
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return get_tp_group().all_reduce(hidden)

    def load_weight(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        if tensor.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: vocabulary {self.vocab_size} vs checkpoint "
                             f"{tuple(tensor.shape)}")
        n = self.num_real_rows
        if isinstance(tensor, QuantizedRows):
            self._load_quantized(param, tensor.narrow(0, self.vocab_start, n))
            return
        param.data[n:].zero_()
        default_weight_loader(param.data[:n], tensor.narrow(0, self.vocab_start, n))

    def _load_quantized(self, param: nn.Parameter, rows: QuantizedRows) -> None:
        """This shard's rows, padded with zero rows past the vocabulary."""
        pad = self.shard_size - rows.shape[0]
        q, scales, mins = (F.pad(t, (0, 0, 0, pad)) for t in (rows.q, rows.scales, rows.mins))
        self.quantized = GroupedIntWeight.from_values(q, scales, mins, rows.group_size,
                                                      rows.bits)
        param.data = torch.empty(0, dtype=param.dtype)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states (N, hidden) onto float32 logits (N, vocab). Each rank computes
    its vocabulary slice; the slices are gathered on the TP group's first rank (the one that
    samples), and the other ranks get None."""

    cpu_gemm: CpuGemm | None = None  # set on CPU by loader.weights.optimize_layout

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.quantized is not None:
            logits = quant_linear(hidden, self.quantized)  # (N, vocab / tp) float32
        elif self.cpu_gemm is not None:
            logits = self.cpu_gemm(hidden).float()  # (N, vocab / tp)
        else:
            logits = F.linear(hidden, self.weight).float()
        if self.tp_size == 1:
            return logits
        full = get_tp_group().gather(logits, dim=-1)
        return None if full is None else full[:, :self.vocab_size]
