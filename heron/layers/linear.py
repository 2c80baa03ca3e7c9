"""Linear layers that load their checkpoint tensors, whole or as this rank's tensor-parallel
shard (vLLM's names), and delegate how the weight is stored to a ``quant.base.LinearMethod``.

A layer knows its shapes and its slice: ``in_features`` / ``out_features`` (this rank's),
``output_sizes`` (this rank's rows of each fused projection, at ``offsets``), where its shard
starts in the checkpoint (``shard_start``, ``input_start``). Its method creates the
parameters (each with a ``ParamLayout``), repacks them after loading and runs the matmul; the
default is ``UnquantizedLinearMethod``, and ``set_quant_method`` swaps in another while the
model is still on the meta device (on CPU, ``layers.cpu_gemm.use_cpu_gemm`` swaps a float32
layer's for its packed-weight method once loaded). ``forward`` only calls the method.

``load_weight(param, tensor, shard_id)`` copies a checkpoint tensor (plain, or a
``loader.lazy_tensor.LazyTensor`` not read yet) into a parameter: it narrows the tensor to
this rank's slice through the parameter's layout first, so a sharded rank reads only that
slice, whatever the format packs. Fused layers (qkv, gate_up) load each HF projection into its
row range. (The hook lives on the module, not the parameter, so it survives ``to_empty``.)

Megatron-style sharding, one all-reduce per pair: a column-parallel layer splits the output
features (rank r computes its slice of y, no communication), the row-parallel layer after it
splits the input features (each rank a partial sum of y, all-reduced).
"""

from __future__ import annotations

import torch
from torch import nn

from heron.distributed import get_tp_group
from heron.distributed.parallel_state import divide, kv_heads_per_rank
from heron.quant.base import VECTOR, LinearMethod, UnquantizedLinearMethod, add_param


def default_weight_loader(param: nn.Parameter, tensor, shard_id=None) -> None:
    """Copy ``tensor`` (cast to the parameter's dtype) into ``param``; shapes must agree. A
    tensor not read yet (``loader.lazy_tensor.LazyTensor``) is read here."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(tensor.shape)}")
    param.data.copy_(tensor.materialize() if hasattr(tensor, "materialize") else tensor)


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b); W: (out_features, in_features), whole on every rank."""

    input_sharded = False  # True where each rank holds a slice of the input features

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 output_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._set_local_sizes(output_sizes or [out_features])
        self.param_layouts: dict = {}
        self.optional_params: set[str] = set()
        self.loaded_params: set[str] = set()  # names load_weight has filled
        if bias:
            add_param(self, "bias", (out_features,), torch.get_default_dtype(), VECTOR)
        else:
            self.register_parameter("bias", None)
        self.quant_method: LinearMethod = UnquantizedLinearMethod()
        self.quant_method.create_weights(self, torch.get_default_dtype())

    def _set_local_sizes(self, local_sizes: list[int]) -> None:
        self.output_sizes = list(local_sizes)
        self.offsets = [0]
        for size in local_sizes:
            self.offsets.append(self.offsets[-1] + size)

    def set_quant_method(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Replace the weight parameters with ``method``'s (the bias stays); on meta."""
        for name in [n for n in self.param_layouts if n != "bias"]:
            delattr(self, name)
            del self.param_layouts[name]
        self.optional_params.clear()
        self.quant_method = method
        method.create_weights(self, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias)

    def shard_start(self, shard_id: int) -> int:
        """Where this rank's rows of projection ``shard_id`` start in the checkpoint's."""
        return 0

    @property
    def input_start(self) -> int:
        """Where this rank's input features start in the checkpoint's."""
        return 0

    def _name_of(self, param: nn.Parameter) -> str:
        for name, own in self.named_parameters(recurse=False):
            if own is param:
                return name
        raise ValueError("the parameter does not belong to this layer")

    def load_weight(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        name = self._name_of(param)
        self.loaded_params.add(name)
        if hasattr(self.quant_method, "load_weight"):  # formats that decode while loading
            self.quant_method.load_weight(self, name, tensor, shard_id)
            return
        layout, shard = self.param_layouts[name], shard_id or 0
        dst = param.data
        if layout.per_shard:  # one entry per fused projection (dims after the first: its own)
            if layout.input_dim is not None and self.input_sharded:
                start, length = layout.input_slice(self.input_start, self.in_features)
                tensor = tensor.narrow(layout.input_dim - 1, start, length)
            src = tensor.materialize() if hasattr(tensor, "materialize") else tensor
            default_weight_loader(dst[shard], src.reshape(dst[shard].shape))
            return
        if layout.output_dim is not None:
            rows = self.output_sizes[shard]
            start, length = layout.output_slice(self.shard_start(shard), rows)
            tensor = tensor.narrow(layout.output_dim, start, length)
            dst = dst.narrow(layout.output_dim, layout.output_slice(self.offsets[shard],
                                                                    rows)[0], length)
        if layout.input_dim is not None and self.input_sharded:
            start, length = layout.input_slice(self.input_start, self.in_features)
            tensor = tensor.narrow(layout.input_dim, start, length)
        default_weight_loader(dst, tensor)


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split across the TP ranks: rank r holds rows
    [r * out / tp, (r + 1) * out / tp) of W and b, and outputs that slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 output_sizes: list[int] | None = None) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        super().__init__(in_features, divide(out_features, self.tp_size, "output features"),
                         bias, output_sizes)

    def shard_start(self, shard_id: int) -> int:
        return self.tp_rank * self.output_sizes[shard_id]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up).

    Each rank holds its slice of every projection: local rows [offsets[i], offsets[i + 1])
    are this rank's part of projection ``i`` (``output_sizes[i] / tp`` rows).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        tp = get_tp_group().world_size
        local = [divide(size, tp, "a merged projection's size") for size in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, local)

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
        ColumnParallelLinear.__init__(self, hidden_size, sum(sizes) * tp, bias, sizes)

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
        self.input_sharded = self.tp_size > 1
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features, bias)

    @property
    def input_start(self) -> int:
        return self.tp_rank * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = get_tp_group().all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias
