"""Process groups of tensor, context and pipeline parallelism, and their collectives.

World rank ``r = (pp_rank * cp_size + cp_rank) * tp_size + tp_rank``: the ranks of one
pipeline stage are contiguous (``cp_size * tp_size`` of them: tensor and context parallelism
inside a node, stages across nodes), and inside a stage each CP rank's TP group is
contiguous. Groups:

* TP: the ``tp_size`` ranks of one (stage, CP rank), which split every layer;
* CP: the ``cp_size`` ranks of one stage with the same ``tp_rank`` (the same KV heads),
  which each hold every ``cp_size``-th KV block and merge their partial attention
  (``heron.attention.context_parallel``);
* PP: the ranks with the same (CP rank, TP rank) across stages.

The driver, whose step results the core reads, is TP rank 0 and CP rank 0 of the last stage:
world rank ``(pp_size - 1) * cp_size * tp_size`` (``driver_rank``).

Until ``init_parallel`` runs (a single process) every group is the trivial group of this
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

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """The members' ``t`` stacked in a new leading dim (group order) on every member:
        ``(world_size, *t.shape)``."""
        if self.world_size == 1:
            return t.unsqueeze(0)
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in self.ranks]
        _timed_collective(lambda: dist.all_gather(parts, t, group=self.group), t)
        return torch.stack(parts)

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

    def ring_exchange(self, send: torch.Tensor, recv: torch.Tensor):
        """Start sending ``send`` to the next member (in group order, wrapping round) and
        receiving the previous member's into ``recv``; returns ``wait()``, which blocks until
        both are done. The caller computes in between (the transfer overlaps it)."""
        n, me = self.world_size, self.rank_in_group
        send = send.contiguous()
        started = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, self.ranks[(me + 1) % n], self.group),
               dist.P2POp(dist.irecv, recv, self.ranks[(me - 1) % n], self.group)]
        works = dist.batch_isend_irecv(ops)
        COMM.p2p_s += time.perf_counter() - started

        def wait() -> None:
            waited = time.perf_counter()
            for work in works:
                work.wait()
            COMM.p2p_s += time.perf_counter() - waited
            COMM.p2p_bytes += send.numel() * send.element_size()

        return wait


_GROUPS = {"tp": GroupCoordinator.solo(), "cp": GroupCoordinator.solo(),
           "pp": GroupCoordinator.solo()}


def get_tp_group() -> GroupCoordinator:
    return _GROUPS["tp"]


def get_cp_group() -> GroupCoordinator:
    return _GROUPS["cp"]


def get_pp_group() -> GroupCoordinator:
    return _GROUPS["pp"]


def world_rank(tp_rank: int, cp_rank: int, pp_rank: int, tp: int, cp: int) -> int:
    return (pp_rank * cp + cp_rank) * tp + tp_rank


def driver_rank(tp: int, pp: int, cp: int = 1) -> int:
    """The world rank whose step results the core reads: TP and CP rank 0 of the last stage."""
    return world_rank(0, 0, pp - 1, tp, cp)


def group_ranks(tp: int, pp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Every TP, CP and PP group as lists of world ranks, by kind."""
    def rank(t, c, s):
        return world_rank(t, c, s, tp, cp)

    return {
        "tp": [[rank(t, c, s) for t in range(tp)] for s in range(pp) for c in range(cp)],
        "cp": [[rank(t, c, s) for c in range(cp)] for s in range(pp) for t in range(tp)],
        "pp": [[rank(t, c, s) for s in range(pp)] for c in range(cp) for t in range(tp)],
    }


def init_parallel(rank: int, tp: int, pp: int, init_method: str, backend: str,
                  timeout_s: float, cp: int = 1) -> None:
    """Join the world (``tp * cp * pp`` ranks) and build this rank's TP, CP and PP groups.

    ``timeout_s`` bounds every collective: a peer that hangs surfaces as an error on the
    others instead of a hang.
    """
    world = tp * cp * pp
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    # every process must create every group, in the same order
    for kind, groups in group_ranks(tp, pp, cp).items():
        for ranks in groups:
            group = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
            if rank in ranks:
                _GROUPS[kind] = GroupCoordinator(ranks, rank, group)


def destroy_parallel() -> None:
    for kind in _GROUPS:
        _GROUPS[kind] = GroupCoordinator.solo()
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
