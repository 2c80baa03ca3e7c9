"""Process groups of tensor and pipeline parallelism, and the collectives the layers use.

World rank ``r = pp_rank * tp_size + tp_rank``: the ranks of one pipeline stage are
contiguous (one TP group per stage: tensor parallelism inside a node, stages across nodes),
and the ranks with the same ``tp_rank`` form a PP group, one per TP rank.

Until ``init_parallel`` runs (a single process) both groups are the trivial group of this
process alone and every collective is the identity, so a model built without
torch.distributed runs unchanged.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from heron.distributed.pipeline import stage_layers


@dataclass
class CommStats:
    """Time this rank spent in communication (waiting for its peers included) and the bytes
    it contributed: collectives (all-reduce, gather, broadcast) and point-to-point (send /
    recv between pipeline stages)."""

    collective_s: float = 0.0
    collective_bytes: int = 0
    collective_calls: int = 0
    p2p_s: float = 0.0
    p2p_bytes: int = 0


COMM = CommStats()  # this process's totals


def _timed_collective(fn, t: torch.Tensor):
    started = time.perf_counter()
    out = fn()
    COMM.collective_s += time.perf_counter() - started
    COMM.collective_bytes += t.numel() * t.element_size()
    COMM.collective_calls += 1
    return out


def _timed_p2p(fn, t: torch.Tensor):
    started = time.perf_counter()
    out = fn()
    COMM.p2p_s += time.perf_counter() - started
    COMM.p2p_bytes += t.numel() * t.element_size()
    return out


class GroupCoordinator:
    """One process group as this rank sees it: its members (world ranks), its own index, and
    the collectives heron needs. Collectives on a group of one return their input."""

    def __init__(self, ranks: list[int], rank: int, group=None) -> None:
        self.ranks = list(ranks)
        self.rank = rank  # world rank of this process
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)
        self.group = group

    @classmethod
    def solo(cls) -> GroupCoordinator:
        return cls([0], 0)

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place."""
        if self.world_size > 1:
            _timed_collective(lambda: dist.all_reduce(t, group=self.group), t)
        return t

    def gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """The members' ``t`` concatenated along ``dim`` on the group's first rank; None on
        the others."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in self.ranks] if self.is_first else None
        _timed_collective(lambda: dist.gather(t, parts, dst=self.ranks[0], group=self.group), t)
        return torch.cat(parts, dim=dim) if self.is_first else None

    def broadcast(self, t: torch.Tensor, src_in_group: int = 0) -> torch.Tensor:
        """The value of member ``src_in_group``'s ``t`` on every member, in place."""
        if self.world_size > 1:
            _timed_collective(
                lambda: dist.broadcast(t, src=self.ranks[src_in_group], group=self.group), t)
        return t

    def send(self, t: torch.Tensor, dst_in_group: int) -> None:
        t = t.contiguous()
        _timed_p2p(lambda: dist.send(t, dst=self.ranks[dst_in_group], group=self.group), t)

    def recv(self, t: torch.Tensor, src_in_group: int) -> torch.Tensor:
        _timed_p2p(lambda: dist.recv(t, src=self.ranks[src_in_group], group=self.group), t)
        return t


_TP = GroupCoordinator.solo()
_PP = GroupCoordinator.solo()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def group_ranks(tp: int, pp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(TP groups, PP groups) as lists of world ranks."""
    tp_groups = [[stage * tp + t for t in range(tp)] for stage in range(pp)]
    pp_groups = [[stage * tp + t for stage in range(pp)] for t in range(tp)]
    return tp_groups, pp_groups


def init_parallel(rank: int, tp: int, pp: int, init_method: str, backend: str,
                  timeout_s: float) -> None:
    """Join the world (``tp * pp`` ranks) and build this rank's TP and PP groups.

    ``timeout_s`` bounds every collective: a peer that hangs surfaces as an error on the
    others instead of a hang.
    """
    global _TP, _PP
    world = tp * pp
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    tp_groups, pp_groups = group_ranks(tp, pp)
    # every process must create every group, in the same order
    for kind, groups in (("tp", tp_groups), ("pp", pp_groups)):
        for ranks in groups:
            group = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
            if rank in ranks:
                coordinator = GroupCoordinator(ranks, rank, group)
                if kind == "tp":
                    _TP = coordinator
                else:
                    _PP = coordinator


def destroy_parallel() -> None:
    global _TP, _PP
    _TP, _PP = GroupCoordinator.solo(), GroupCoordinator.solo()
    if dist.is_initialized():
        dist.destroy_process_group()


def divide(n: int, parts: int, what: str) -> int:
    """``n / parts`` (``what``: named in the error when it does not divide)."""
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {parts}")
    return n // parts


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> tuple[int, int]:
    """(KV heads on each rank, ranks sharing each KV head): ``num_kv_heads / tp`` heads each,
    or, when tp >= num_kv_heads, one head replicated on ``tp / num_kv_heads`` ranks."""
    if tp < num_kv_heads:
        return divide(num_kv_heads, tp, "the number of KV heads"), 1
    if tp % num_kv_heads:
        raise ValueError(f"the tensor-parallel size {tp} exceeds the {num_kv_heads} KV heads "
                         f"but is not a multiple of them")
    return 1, tp // num_kv_heads


def check_model_fits(num_heads: int, num_kv_heads: int, intermediate_size: int,
                     num_layers: int, tp: int, pp: int) -> None:
    """ValueError unless a model of these sizes splits over ``tp`` x ``pp`` ranks: checked
    by the core before it starts any rank, with the rules the layers split by."""
    divide(num_heads, tp, "the number of attention heads")
    kv_heads_per_rank(num_kv_heads, tp)
    divide(intermediate_size, tp, "the MLP size")
    stage_layers(num_layers, 0, pp)
