"""Context-parallel prefill split in one process: N CP ranks simulated by threads, each
running only its stripes of the step's prefill rows (and every decode) and passing K/V round
a ring of queues, give the torch backend's attention over the whole pool, for steps mixing
fresh prompts, later chunks of cached prompts and decodes (GQA, sliding windows); and every
rank's pool ends holding exactly its blocks of the whole pool."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from attention_steps import table_metadata, table_slots
from heron.attention.context_parallel import ContextParallelAttention
from heron.attention.context_parallel_ring import split_tokens
from heron.attention.torch_backend import TorchAttentionBackend

H, KVH, D, BS = 6, 2, 8, 4
STRIPE = 2


class _Hub:
    """What the simulated ranks share: a queue into each rank (its ring predecessor puts),
    and a barrier-guarded table for all-gathers."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.inbox = [queue.Queue() for _ in range(n)]
        self.barrier = threading.Barrier(n, timeout=30)
        self.table: list[torch.Tensor | None] = [None] * n


class _ThreadGroup:
    """The CP group as one simulated rank sees it (the GroupCoordinator calls the ring and
    the decode merge use)."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank_in_group, self.world_size = hub, rank, hub.n

    def ring_exchange(self, send, recv):
        self.hub.inbox[(self.rank_in_group + 1) % self.world_size].put(send.clone())

        def wait():
            recv.copy_(self.hub.inbox[self.rank_in_group].get(timeout=30))
        return wait

    def all_gather(self, t):
        hub = self.hub
        hub.table[self.rank_in_group] = t.clone()
        hub.barrier.wait()
        out = torch.stack(hub.table)
        hub.barrier.wait()
        return out


def _run_ranks(n, pools, q, k, v, md_of, window):
    """Every simulated rank's attention for its rows -> (T, H, D), the step's output."""
    hub, out = _Hub(n), torch.full_like(q, float("nan"))
    errors = []

    def rank_main(r):
        try:
            md = md_of()
            split = split_tokens(md.query_lens_cpu, md.query_start_loc_cpu, md.seq_lens_cpu,
                                 r, n, STRIPE)
            assert split is not None
            md.cp_split = split
            rows = split.local_rows
            got = ContextParallelAttention(_ThreadGroup(hub, r)).forward(
                q[rows], k[rows], v[rows], pools[r], md, 0.25, window)
            mine = split.prefill_rows[r]
            out[mine] = got[split.prefill_local]
            if r == 0:
                out[split.decode_rows] = got[split.decode_local]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_split_prefill_over_a_ring_equals_one_pool(n, window):
    torch.manual_seed(10 + n)
    num_blocks = 36
    ids = torch.randperm(num_blocks).tolist()
    tables = [ids[0:6], ids[6:12], ids[12:15], ids[15:20]]  # 24, 24, 12, 20 tokens
    full = torch.zeros(2, num_blocks, BS, KVH, D)
    pools = [torch.zeros(2, num_blocks // n, BS, KVH, D) for _ in range(n)]
    backend = TorchAttentionBackend()
    # step 1: fresh prompts of 13, 9, 1 and 17 tokens; step 2: two decodes and the second
    # chunks of prompts 3 and 4 (9 and 3 tokens after 1 and 17 cached: old keys in shards)
    steps = [((13, 9, 1, 17), (0, 0, 0, 0)), ((1, 1, 9, 3), (13, 9, 1, 17))]
    for query_lens, cached in steps:
        seq_lens = [c + q for c, q in zip(cached, query_lens)]
        slots = torch.tensor([s for t, c, q in zip(tables, cached, query_lens)
                              for s in table_slots(t, c, q, BS)])
        t = sum(query_lens)
        q, k, v = torch.randn(t, H, D), torch.randn(t, KVH, D), torch.randn(t, KVH, D)
        def metadata():
            return table_metadata(tables, seq_lens, query_lens, slots, BS)

        ref = backend.forward(q, k, v, full, metadata(), 0.25, window)
        out = _run_ranks(n, pools, q, k, v, metadata, window)
        assert (out - ref).abs().max() < 1e-5
    for r, pool in enumerate(pools):  # rank r holds blocks id % n == r, at id // n
        for b in range(num_blocks):
            if b % n == r:
                assert torch.equal(pool[:, b // n], full[:, b])


def test_stripes_deal_prefill_rows_evenly_and_keep_decodes_everywhere():
    # a decode, then prompts of 10 and 7 tokens (7 after 5 cached): stripes of 2 counted
    # from the first prefill row's position (0)
    split = split_tokens([1, 10, 7], [0, 1, 11, 18], [30, 10, 12], 1, 2, 2)
    assert split.decode_rows.tolist() == [0]
    assert split.prefill_rows[0].tolist() == [1, 2, 5, 6, 9, 10, 13, 14, 17]
    assert split.prefill_rows[1].tolist() == [3, 4, 7, 8, 11, 12, 15, 16]
    assert split.local_rows.tolist() == [0, 3, 4, 7, 8, 11, 12, 15, 16]
    assert split.decode_local.tolist() == [0]
    assert split_tokens([1, 3], [0, 1, 4], [9, 3], 0, 2, 2) is None  # 3 rows: not split
