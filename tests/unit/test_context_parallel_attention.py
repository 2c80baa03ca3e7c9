"""Context parallelism's attention in one process: partial attentions with their log-sum-exp
merge into full attention (against a float64 reference), and N simulated CP ranks, each
writing and reading only its blocks of the pool, give the torch backend's output over the
whole pool for a mixed step of prefill chunks and decodes (GQA, sliding windows)."""

from __future__ import annotations

import pytest
import torch

from attention_steps import table_metadata, table_slots
from heron.attention.context_parallel import ContextParallelAttention, local_plan
from heron.attention.partial_attention import attend_partial, merge_partials
from heron.attention.torch_backend import TorchAttentionBackend

H, KVH, D, BS = 6, 2, 8, 4


def _reference(q, k, v, key_pos, query_pos, scale, window):
    """float64 softmax attention: q (Q, H, D), k, v (L, KVH, D)."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    scores = torch.einsum("qhd,lhd->hql", q.double(), k) * scale
    seen = key_pos[None] <= query_pos[:, None]
    if window is not None:
        seen &= key_pos[None] > query_pos[:, None] - window
    scores = scores.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("parts", [2, 3])
def test_merged_partials_equal_full_attention(parts, window):
    torch.manual_seed(parts)
    q_len, seq_len = 9, 40
    q = torch.randn(q_len, H, D)
    k, v = torch.randn(seq_len, KVH, D), torch.randn(seq_len, KVH, D)
    key_pos = torch.arange(seq_len)
    query_pos = torch.arange(seq_len - q_len, seq_len)
    # keys dealt to the parts in blocks of 4 (part 0 gets none of the window's keys for some
    # queries when a window is set: those partials are empty)
    owner = (key_pos // BS) % parts
    outs, lses = [], []
    for p in range(parts):
        sel = (owner == p).nonzero().squeeze(1)
        out, lse = attend_partial(q[None], k[sel][None], v[sel][None], key_pos[sel][None],
                                  query_pos[None], 0.3, window)
        outs.append(out[0])
        lses.append(lse[0])
    out, _ = merge_partials(torch.stack(outs), torch.stack(lses))
    ref = _reference(q, k, v, key_pos, query_pos, 0.3, window)
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-5
    assert torch.isinf(torch.stack(lses)).any() or window is None


class _Ranks:
    """N CP ranks simulated in one process: each its own pool; the all-gather stacks their
    partials in rank order, as the group's collective does."""

    def __init__(self, n: int, num_blocks: int) -> None:
        self.n = n
        self.pools = [torch.zeros(2, num_blocks // n, BS, KVH, D) for _ in range(n)]

    def forward(self, q, k, v, md_of, scale, window):
        parts = []
        for r in range(self.n):
            md = md_of()
            plan = md.backend_cache["cp"] = local_plan(md, r, self.n)
            pool = self.pools[r]
            pool[0].view(-1, KVH, D).index_copy_(0, plan.write_slots, k[plan.write_rows])
            pool[1].view(-1, KVH, D).index_copy_(0, plan.write_slots, v[plan.write_rows])
            parts.append(ContextParallelAttention._partial(q, pool[0], pool[1], plan, scale,
                                                           window))
        gathered = torch.stack(parts)
        return merge_partials(gathered[..., :D], gathered[..., D])[0]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("n", [2, 4])
def test_simulated_ranks_equal_one_pool(n, window):
    torch.manual_seed(n)
    num_blocks = 32
    ids = torch.randperm(num_blocks).tolist()
    tables = [ids[0:6], ids[6:12], ids[12:15], ids[15:20]]  # 24, 24, 12, 20 token capacity
    full = torch.zeros(2, num_blocks, BS, KVH, D)
    ranks, backend = _Ranks(n, num_blocks), TorchAttentionBackend()
    # step 1: prefill chunks of 13, 9, 1 (a decode-shaped first token) and 17 tokens;
    # step 2: two decodes and two more chunks (5 and 2 tokens)
    steps = [((13, 9, 1, 17), (0, 0, 0, 0)), ((1, 1, 5, 2), (13, 9, 1, 17))]
    for query_lens, cached in steps:
        seq_lens = [c + q for c, q in zip(cached, query_lens)]
        slots = torch.tensor([s for t, c, q in zip(tables, cached, query_lens)
                              for s in table_slots(t, c, q, BS)])
        t = sum(query_lens)
        q, k, v = torch.randn(t, H, D), torch.randn(t, KVH, D), torch.randn(t, KVH, D)
        def metadata():
            return table_metadata(tables, seq_lens, query_lens, slots, BS)

        ref = backend.forward(q, k, v, full, metadata(), 0.25, window)
        out = ranks.forward(q, k, v, metadata, 0.25, window)
        assert (out - ref).abs().max() < 1e-5
    # each rank's pool holds exactly its blocks (id % n == rank, at id // n), nothing else
    for r, pool in enumerate(ranks.pools):
        for b in range(num_blocks):
            if b % n == r:
                assert torch.equal(pool[:, b // n], full[:, b])
        assert torch.count_nonzero(pool) < torch.count_nonzero(full)
    assert sum(torch.count_nonzero(p) for p in ranks.pools) == torch.count_nonzero(full)


def test_a_rank_writes_only_tokens_of_its_blocks():
    tables = [[5, 2, 7]]
    md = table_metadata(tables, [11], [11], torch.tensor(table_slots(tables[0], 0, 11, BS)), BS)
    plan = local_plan(md, 1, 2)  # blocks 5 and 7 are rank 1's, at local 2 and 3
    assert plan.write_rows.tolist() == [0, 1, 2, 3, 8, 9, 10]
    assert plan.write_slots.tolist() == [8, 9, 10, 11, 12, 13, 14]
    keys = plan.prefills[0][2]
    assert keys.blocks.tolist() == [[2, 3]]
    assert keys.key_pos.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11]]
