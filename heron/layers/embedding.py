"""Token embedding and the LM head (which may share the embedding's weight), split by
vocabulary across the tensor-parallel ranks.

The vocabulary is padded to a multiple of the TP size; rank r holds rows
[r * V / tp, (r + 1) * V / tp) of the (padded) table, zero past the real vocabulary.

How the table is stored is the layer's ``quant_method`` (``quant.base``'s seam, as for every
linear layer): ``embedding`` looks rows up, ``apply`` is the LM head's matmul. The default is
``UnquantizedEmbeddingMethod``; a GGUF table loaded kept quantized switches to
``GGUFEmbeddingMethod``, and on CPU the loader gives a float32 LM head
``layers.cpu_gemm.CpuGemmMethod``.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.distributed import get_tp_group
from heron.layers.linear import default_weight_loader
from heron.quant.base import LinearMethod, UnquantizedEmbeddingMethod
from heron.quant.gguf_blocks import QuantizedRows
from heron.quant.methods.gguf import GGUFEmbeddingMethod


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
        # how the table is stored (see the module docstring); shared with a tied LM head
        self.quant_method: LinearMethod = UnquantizedEmbeddingMethod()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        hidden = self.quant_method.embedding(self, local.masked_fill(outside, 0))
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return get_tp_group().all_reduce(hidden)

    def load_weight(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        """This rank's rows of the checkpoint table; GGUF rows kept quantized (``QuantizedRows``)
        become a ``GGUFEmbeddingMethod`` and leave ``weight`` empty."""
        if tensor.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: vocabulary {self.vocab_size} vs checkpoint "
                             f"{tuple(tensor.shape)}")
        n = self.num_real_rows
        if isinstance(tensor, QuantizedRows):
            self.quant_method = GGUFEmbeddingMethod.from_rows(
                tensor.narrow(0, self.vocab_start, n), self.shard_size)
            param.data = torch.empty(0, dtype=param.dtype)
            return
        param.data[n:].zero_()
        default_weight_loader(param.data[:n], tensor.narrow(0, self.vocab_start, n))


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states (N, hidden) onto float32 logits (N, vocab) through its method's
    ``apply``. Each rank computes its vocabulary slice; the slices are gathered on the TP
    group's first rank (the one that samples), and the other ranks get None."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.quant_method.apply(self, hidden).float()  # (N, vocab / tp)
        if self.tp_size == 1:
            return logits
        full = get_tp_group().gather(logits, dim=-1)
        return None if full is None else full[:, :self.vocab_size]
