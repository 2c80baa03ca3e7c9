"""Tree attention masks (``AttentionMetadata.tree_masks``, speculative tree verification) in
every attention backend, against a float64 oracle that attends each tree node to its context
plus its own root-to-node path only, with plain causal attention.

One step mixes a decode, a tree after a context (crossing a page), an ordinary chunk after a
cached prefix, a tree without context and a one-node tree; GQA (4 query heads, 2 KV heads),
block size 4, shuffled block tables. The triton backend runs under the Triton CPU interpreter
and is skipped where triton is not importable.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton kernel is defined

import pytest  # noqa: E402
import torch  # noqa: E402

from heron.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from heron.kernels import cases, cpu, reference  # noqa: E402

BLOCK_SIZE, KV_HEADS, GROUP, HEAD_DIM, SCALE = 4, 2, 2, 32, 32 ** -0.5
# parents of the nodes of a candidate tree (-1: the root): root 0 with children 1, 2; node 1
# with children 3, 4
TREE = [-1, 0, 0, 1, 1]
# the same shape, nodes not in topological order (node 0's parent is node 2)
SHUFFLED_TREE = [2, 2, -1, 0, 0]
BACKENDS = ["torch", "cpu", "triton"]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """(Q, Q) bool: mask[a, b] iff b is a or one of its ancestors."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for a in range(len(parents)):
        b = a
        while b != -1:
            mask[a, b] = True
            b = parents[b]
    return mask


def backend(name: str):
    if name == "triton":
        pytest.importorskip("triton")
    if name == "cpu" and not cpu.load():
        pytest.skip("heron's C++ CPU kernel did not build")
    return get_attention_backend(name)


def make_step(q_lens, seq_lens, trees: dict[int, list[int]], seed=0):
    """A step over a random paged cache; trees: request index -> parents of its Q_i nodes.
    Returns (q, k, v, kv_cache, md, case, slots)."""
    case = cases.attention_case(q_lens, seq_lens, KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE,
                                torch.float32, seed=seed)
    starts, seq_lens_t, tables = case.device_tensors()
    slots = [case.block_tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (q, s) in enumerate(zip(q_lens, seq_lens)) for p in range(s - q, s)]
    k = cases.randn(sum(q_lens), KV_HEADS, HEAD_DIM, dtype=torch.float32, seed=seed + 10)
    v = cases.randn(sum(q_lens), KV_HEADS, HEAD_DIM, dtype=torch.float32, seed=seed + 11)
    md = AttentionMetadata(torch.tensor(slots), tables, seq_lens_t, starts, case.query_start_loc,
                           list(q_lens), list(seq_lens), block_size=BLOCK_SIZE,
                           tree_masks={i: tree_mask(p) for i, p in trees.items()})
    kv_cache = torch.stack([case.key_cache, case.value_cache])
    return case.q, k, v, kv_cache, md, case, slots


def oracle(case, k, v, slots, trees: dict[int, list[int]]) -> torch.Tensor:
    """float64 (T, H, D): ordinary requests causal; tree node a attends to the context and
    the nodes on its root-to-a path only (as the last position, so causally to all of them)."""
    key_cache, value_cache = reference.store_kv(k, v, case.key_cache, case.value_cache, slots)
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    for i, seq_len in enumerate(case.seq_lens):
        start, end = case.query_start_loc[i], case.query_start_loc[i + 1]
        keys = reference.gather_context(key_cache, case.block_tables[i], seq_len)
        values = reference.gather_context(value_cache, case.block_tables[i], seq_len)
        if i not in trees:
            out[start:end] = reference.attention_one(case.q[start:end], keys, values, SCALE,
                                                     None)
            continue
        context = seq_len - (end - start)
        mask = tree_mask(trees[i])
        for a in range(end - start):
            seen = torch.cat([torch.arange(context), context + mask[a].nonzero().flatten()])
            out[start + a:start + a + 1] = reference.attention_one(
                case.q[start + a:start + a + 1], keys[seen], values[seen], SCALE, None)
    return out


# decode; tree after 6 context tokens (positions 6..10 cross the page at 8); a chunk of 7
# after a cached prefix of 5; a tree without context; a one-node tree (a decode)
Q_LENS, SEQ_LENS = [1, 5, 7, 5, 1], [9, 11, 12, 5, 7]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("parents", [TREE, SHUFFLED_TREE], ids=["tree", "shuffled"])
def test_mixed_step_with_trees_matches_the_path_oracle(name, parents):
    trees = {1: parents, 3: parents, 4: [-1]}
    q, k, v, kv_cache, md, case, slots = make_step(Q_LENS, SEQ_LENS, trees)
    expected = oracle(case, k, v, slots, trees)
    got = backend(name).forward(q, k, v, kv_cache, md, SCALE)
    assert reference.max_rel_error(got, expected) <= 1e-5
    # the K/V of every node was stored in its own slot
    stored = reference.store_kv(k, v, case.key_cache, case.value_cache, slots)
    assert torch.equal(kv_cache.double(), torch.stack(stored))
    # the tree actually changes the result: causal attention over the nodes differs
    md.tree_masks, md.backend_cache = None, {}
    causal = get_attention_backend("torch").forward(q, k, v, kv_cache.clone(), md, SCALE)
    tree_tokens = slice(1, 6)
    assert reference.max_rel_error(causal[tree_tokens], expected[tree_tokens]) > 1e-2


@pytest.mark.parametrize("name", BACKENDS)
def test_reversed_chain_spanning_query_and_key_tiles(name):
    """70 nodes, each the child of the next (every ancestor after its node), after 3 context
    tokens: more queries than one Triton query tile, keys over two key tiles."""
    chain = list(range(1, 70)) + [-1]
    trees = {0: chain}
    q, k, v, kv_cache, md, case, slots = make_step([70, 1], [73, 6], trees, seed=3)
    got = backend(name).forward(q, k, v, kv_cache, md, SCALE)
    assert reference.max_rel_error(got, oracle(case, k, v, slots, trees)) <= 1e-5


@pytest.mark.parametrize("name", BACKENDS)
def test_lower_triangular_tree_mask_is_the_causal_result(name):
    attn = backend(name)
    q, k, v, kv_cache, md, case, slots = make_step(Q_LENS, SEQ_LENS, {})
    md.tree_masks = None
    causal = attn.forward(q, k, v, kv_cache.clone(), md, SCALE)
    chain = {i: torch.ones(n, n, dtype=torch.bool).tril() for i, n in enumerate(Q_LENS)}
    md.tree_masks, md.backend_cache = chain, {}
    got = attn.forward(q, k, v, kv_cache.clone(), md, SCALE)
    if name == "cpu":  # trees take the torch path there, the rest the C++ kernel
        assert reference.max_rel_error(got, causal) <= 1e-5
    else:
        assert torch.equal(got, causal)


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_tree_masks_are_refused(name):
    attn = backend(name)
    q, k, v, kv_cache, md, *_ = make_step(Q_LENS, SEQ_LENS, {1: TREE})
    with pytest.raises(ValueError, match="sliding window"):
        attn.forward(q, k, v, kv_cache.clone(), md, SCALE, sliding_window=4)
    md.tree_masks = {1: tree_mask(TREE)[:4, :4]}
    with pytest.raises(ValueError, match=r"expected a \(5, 5\) bool tensor"):
        attn.forward(q, k, v, kv_cache.clone(), md, SCALE)
    md.tree_masks, md.backend_cache = {1: ~torch.eye(5, dtype=torch.bool)}, {}
    with pytest.raises(ValueError, match="see itself"):
        attn.forward(q, k, v, kv_cache.clone(), md, SCALE)
