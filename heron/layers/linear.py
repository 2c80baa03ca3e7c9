"""Linear layers that load their checkpoint tensors, whole or as this rank's tensor-parallel
shard (vLLM's names).

A module's ``load_weight(param, tensor, shard_id)`` copies a checkpoint tensor (plain, or a
``loader.lazy_tensor.LazyTensor`` not read yet) into one of its parameters: it narrows the
tensor to this rank's slice first, so a sharded rank reads only that slice. Fused layers (qkv,
gate_up) load each HF projection into its row range. (The hook lives on the module, not the
parameter, so it survives ``to_empty`` after meta construction.)

Megatron-style sharding, one all-reduce per pair: a column-parallel layer splits the output
features (rank r computes its slice of y, no communication), the row-parallel layer after it
splits the input features (each rank a partial sum of y, all-reduced).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.distributed import get_tp_group
from heron.distributed.parallel_state import divide, kv_heads_per_rank
from heron.layers.cpu_gemm import CpuGemm


def default_weight_loader(param: nn.Parameter, tensor, shard_id=None) -> None:
    """Copy ``tensor`` (cast to the parameter's dtype) into ``param``; shapes must agree. A
    tensor not read yet (``loader.lazy_tensor.LazyTensor``) is read here."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(tensor.shape)}")
    param.data.copy_(tensor.materialize() if hasattr(tensor, "materialize") else tensor)


def _make_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b); W: (out_features, in_features), whole on every rank.

    On CPU ``loader.weights.optimize_layout`` gives it a ``CpuGemm`` (the weight in the
    layouts MKL/oneDNN are fastest with) that the matmul then goes through."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _make_param(out_features, in_features)
        self.bias = _make_param(out_features) if bias else None
        self.cpu_gemm: CpuGemm | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.cpu_gemm is not None:
            return self.cpu_gemm(x, bias)
        return F.linear(x, self.weight, bias)

    def load_weight(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        default_weight_loader(param, tensor)


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split across the TP ranks: rank r holds rows
    [r * out / tp, (r + 1) * out / tp) of W and b, and outputs that slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        super().__init__(in_features, divide(out_features, self.tp_size, "output features"),
                         bias)

    def load_weight(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        rows = param.shape[0]
        default_weight_loader(param, tensor.narrow(0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up).

    Each rank holds its slice of every projection: local rows [offsets[i], offsets[i + 1])
    are this rank's part of projection ``i`` (``output_sizes[i] / tp`` rows).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        tp = get_tp_group().world_size
        local = [divide(size, tp, "a merged projection's size") for size in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias)
        self._set_local_sizes(local)

    def _set_local_sizes(self, local_sizes: list[int]) -> None:
        self.output_sizes = list(local_sizes)
        self.offsets = [0]
        for size in local_sizes:
            self.offsets.append(self.offsets[-1] + size)

    def shard_start(self, shard_id: int) -> int:
        """Where this rank's slice of projection ``shard_id`` starts in the checkpoint's rows."""
        return self.tp_rank * self.output_sizes[shard_id]

    def load_weight(self, param: nn.Parameter, tensor, shard_id: int) -> None:
        start, end = self.offsets[shard_id], self.offsets[shard_id + 1]
        rows = end - start
        default_weight_loader(param.data[start:end],
                              tensor.narrow(0, self.shard_start(shard_id), rows))

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.output_sizes, dim=-1))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v fused, split by attention heads: each rank holds ``num_heads / tp`` query
    heads and ``num_kv_heads / tp`` KV heads, or, when tp > num_kv_heads, one KV head
    replicated on ``tp / num_kv_heads`` consecutive ranks (grouped-query attention keeps each
    query head with its KV head)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_group().world_size
        self.num_heads = divide(num_heads, tp, "the number of attention heads")
        self.num_kv_heads, self.kv_replicas = kv_heads_per_rank(num_kv_heads, tp)
        self.head_dim = head_dim
        sizes = [self.num_heads * head_dim] + [self.num_kv_heads * head_dim] * 2
        ColumnParallelLinear.__init__(self, hidden_size, sum(sizes) * tp, bias)
        self._set_local_sizes(sizes)

    def shard_start(self, shard_id: int) -> int:
        if shard_id == 0:
            return self.tp_rank * self.output_sizes[0]
        kv_head = (self.tp_rank // self.kv_replicas) * self.num_kv_heads
        return kv_head * self.head_dim


class RowParallelLinear(ReplicatedLinear):
    """Input features split across the TP ranks: rank r holds columns
    [r * in / tp, (r + 1) * in / tp) of W and multiplies its slice of x (the output of a
    column-parallel layer); the partial products are all-reduced, then the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = get_tp_group().all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias

    def load_weight(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        if param is self.bias:
            default_weight_loader(param, tensor)
            return
        cols = param.shape[1]
        default_weight_loader(param, tensor.narrow(1, self.tp_rank * cols, cols))
