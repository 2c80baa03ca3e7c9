"""Invariants of the radix-tree prefix cache under random interleavings of add (requests that
share prefixes, n > 1 siblings), step (match + lock at admission, insert as blocks fill,
eviction under pressure), abort / stop (unlock), preemption and ``reset_prefix_cache``.

The model is simulated by a fake KV store: computing position ``p`` of a request writes the
tuple of its tokens ``[0, p]`` into that slot (the KV of a token depends on everything before
it). A request may then only ever read slots holding exactly its own prefixes, which checks
that every cache hit hands out the right KV, and writes may only land in private blocks.
Steps run as ``EngineCore.step`` drives them (``tests/helpers/scheduler_steps.py``): ``schedule()``,
the fake computation of every scheduled chunk, then ``update_from_output()`` with one fake
token for each sequence whose step samples (it appends the token and applies the length stop).
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from heron.config import SchedulerConfig
from heron.engine.kv_cache import KVCacheManager, cdiv
from heron.engine.prefix_cache import CacheNode
from heron.engine.request import Request, RequestStatus
from heron.engine.scheduler import Scheduler
from heron.sampling_params import SamplingParams
from scheduler_steps import complete, schedule

FAKE_TOKEN = 1
PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [5, 6, 7, 8, 2, 2, 3], [9] * 10)


def _fake_token(request: Request) -> int:
    """Outputs vary a little, so outputs that fill blocks make distinct cache entries."""
    return FAKE_TOKEN + request.num_output_tokens % 3


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), block_size=st.integers(1, 4),
                budget=st.integers(1, 48), max_num_seqs=st.integers(1, 6),
                policy=st.sampled_from(["fcfs", "lpm"]))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, policy):
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
        self.sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget,
                                               max_num_seqs=max_num_seqs, policy=policy,
                                               max_overtakes=3), kv,
                               max_model_len=num_blocks * block_size)
        self.kv, self.bs = kv, block_size
        self.capacity = num_blocks * block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix
        self.live: list[Request] = []
        self.finished: list[Request] = []
        self.ids = itertools.count()

    # ---- the simulated engine --------------------------------------------------------------
    def _step(self) -> None:
        out = schedule(self.sched)
        for s in out.scheduled:
            self._compute(s.request, s.num_tokens)
        complete(self.sched, out, _fake_token)
        self._sync()

    def _compute(self, req: Request, n: int) -> None:
        """Write the fake KV of positions [computed, computed + n) after checking the context."""
        tokens = req.all_token_ids()
        for p in range(req.num_computed_tokens):  # what attention reads
            block = req.block_ids[p // self.bs]
            assert self.slots.get((block, p % self.bs)) == tuple(tokens[:p + 1]), \
                f"{req.request_id} reads wrong KV at position {p} (block {block})"
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            block = req.block_ids[p // self.bs]
            assert self.kv.pool.ref_counts[block] == 1, f"write into shared block {block}"
            assert not self.kv.prefix_cache.holds(block), f"write into cached block {block}"
            self.slots[(block, p % self.bs)] = tuple(tokens[:p + 1])

    def _sync(self) -> None:
        self.finished += [r for r in self.live if r.is_finished]
        self.live = [r for r in self.live if not r.is_finished]

    # ---- rules -----------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 12),
          suffix=st.lists(st.integers(2, 4), max_size=6), max_tokens=st.integers(1, 8),
          copies=st.integers(1, 3))
    def add(self, prefix, cut, suffix, max_tokens, copies):
        prompt = (prefix[:cut] + suffix)[:self.capacity - 1] or [3]
        max_tokens = min(max_tokens, self.capacity - len(prompt))
        for _ in range(copies):  # identical prompts arriving together, like n > 1 siblings
            req = Request(f"r{next(self.ids)}", list(prompt),
                          SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
            self.sched.add(req)
            self.live.append(req)

    @rule(n=st.integers(1, 6))
    def steps(self, n):
        for _ in range(n):
            self._step()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), status=st.sampled_from([RequestStatus.FINISHED_ABORTED,
                                                  RequestStatus.FINISHED_STOPPED]))
    def finish(self, data, status):
        self.sched.finish(data.draw(st.sampled_from(self.live)), status)
        self._sync()

    @rule()
    def reset(self):
        unreferenced = self.kv.prefix_cache.num_unreferenced
        assert self.kv.reset_prefix_cache() == unreferenced
        assert self.kv.prefix_cache.num_unreferenced == 0

    @rule()
    def drain(self):
        bound = 4 * sum(r.num_tokens + r.max_tokens for r in self.live) + 8
        for _ in range(bound):
            if not self.live:
                break
            self._step()
        assert not self.live, f"{len(self.live)} requests left after {bound} steps"
        assert self.kv.num_free_blocks == self.kv.num_blocks
        self.kv.reset_prefix_cache()
        assert len(self.kv.prefix_cache) == 0
        assert sorted(self.kv.pool._free) == list(range(self.kv.num_blocks))

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def blocks_are_free_owned_or_cached_free(self):
        pool, cache = self.kv.pool, self.kv.prefix_cache
        owners = [0] * pool.num_blocks
        for req in self.live:
            assert len(set(req.block_ids)) == len(req.block_ids)
            for b in req.block_ids:
                owners[b] += 1
        free = set(pool._free)
        assert len(free) == len(pool._free), "a block is twice in the free list"
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == owners[b], f"block {b}: ref != live users"
            cached = cache.holds(b)
            assert (b in free) == (owners[b] == 0 and not cached), f"block {b} free-list state"
        cached_free = sum(1 for b in cache.nodes if owners[b] == 0)
        assert cache.num_unreferenced == cached_free
        assert self.kv.num_free_blocks == len(free) + cached_free
        for req in self.finished:
            assert req.block_ids == [] and req.last_cached_node is None

    @invariant()
    def tree_is_consistent(self):
        cache, seen = self.kv.prefix_cache, {}

        def walk(node: CacheNode) -> None:
            for key, child in node.children.items():
                assert child.parent is node and child.tokens == key and len(key) == self.bs
                assert child.block_id not in seen
                seen[child.block_id] = child
                if self.kv.pool.ref_counts[child.block_id] > 0 and not node.is_root:
                    assert self.kv.pool.ref_counts[node.block_id] > 0, \
                        "a referenced block under an unreferenced parent"
                walk(child)

        for root in cache.roots.values():
            walk(root)
        assert seen == cache.nodes

    @invariant()
    def requests_agree_with_the_tree(self):
        for req in self.live:
            tokens = req.all_token_ids()
            node = self.kv.prefix_cache.root(None)
            for i in range(req.num_cached_blocks):
                node = node.children[tuple(tokens[i * self.bs:(i + 1) * self.bs])]
                assert node.block_id == req.block_ids[i]
            assert req.num_cached_blocks <= req.num_computed_tokens // self.bs
            assert (req.last_cached_node or self.kv.prefix_cache.root(None)) is node
            if req.status == RequestStatus.RUNNING:
                assert len(req.block_ids) == cdiv(req.num_computed_tokens, self.bs)
            else:
                assert req.block_ids == [] and req.num_computed_tokens == 0

    def teardown(self):
        if hasattr(self, "sched"):
            self.drain()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=1000, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPrefixCacheInvariants = PrefixCacheMachine.TestCase


# ---- deterministic unit tests ------------------------------------------------------------------
def _scheduler(num_blocks=16, block_size=4, budget=64, max_num_seqs=8, **config):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                     **config), kv, max_model_len=num_blocks * block_size)


def _request(rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens)


def _run(sched: Scheduler, *requests: Request) -> None:
    """Add and run to completion (one fake token per sampling step)."""
    for r in requests:
        sched.add(r)
    for _ in range(200):
        if not sched.has_unfinished():
            return
        complete(sched, schedule(sched), lambda request: FAKE_TOKEN)
    raise AssertionError("did not finish")


def test_lru_evicts_the_least_recently_used_leaf_first():
    sched = _scheduler(num_blocks=6, block_size=4)
    old, new = _request("old", list(range(10, 19))), _request("new", list(range(50, 59)))
    _run(sched, old)
    _run(sched, new)  # 2 cached blocks each, all unreferenced, "old" used longer ago
    cache = sched.kv_cache.prefix_cache
    assert len(cache) == 4 and cache.num_unreferenced == 4
    assert cache.evict(1) == 1
    assert cache.match(list(range(10, 19)), None, 2) and len(
        cache.match(list(range(10, 19)), None, 2)) == 1  # old's leaf went first
    assert len(cache.match(list(range(50, 59)), None, 2)) == 2
    # a hit refreshes: touching "old" again makes "new" the next victim
    _run(sched, _request("old-again", list(range(10, 19))))
    cache.evict(cache.num_unreferenced - 2)
    assert len(cache.match(list(range(10, 19)), None, 2)) == 2


def test_identical_prompts_arriving_together_compute_the_prefix_once():
    sched = _scheduler(budget=8)
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    a, b = _request("a", prompt), _request("b", prompt)
    sched.add(a)
    sched.add(b)
    out = schedule(sched)
    assert [s.request for s in out.scheduled] == [a]  # b waits for a's blocks
    complete(sched, out, lambda request: FAKE_TOKEN)
    _run(sched)
    assert b.num_cached_tokens == 20 and a.num_cached_tokens == 0
    assert sched.stats.num_prefill_tokens == 21 + 1


def test_longest_prefix_first_with_a_fairness_cap():
    sched = _scheduler(budget=64, max_num_seqs=1, policy="lpm", max_overtakes=2)
    shared = list(range(200, 216))
    _run(sched, _request("warm", shared + [1]))
    cold = _request("cold", list(range(300, 317)))
    hot = [_request(f"hot{i}", shared + [2 + i]) for i in range(4)]
    for r in [cold, *hot]:
        sched.add(r)
    order = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out = schedule(sched)
        order += [s.request.request_id for s in out.scheduled
                  if s.request.num_output_tokens == 0 and s.samples]
        sampling = [s.request for s in out.scheduled if s.samples]
        complete(sched, out, lambda request: FAKE_TOKEN)
        # max_tokens=1: the first token finishes each one
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in sampling)
    # hits go first, but "cold" is overtaken at most max_overtakes times
    assert order == ["hot0", "hot1", "cold", "hot2", "hot3"]
    assert cold.num_overtakes == 2


def test_all_blocks_locked_by_a_shared_prefix_still_makes_progress():
    # 6 blocks of 4: two requests sharing 4 blocks need 4 + 2 + 2 > 6 at their peak
    sched = _scheduler(num_blocks=6, block_size=4, budget=8, max_num_seqs=2)
    prompt = list(range(400, 417))
    a, b = _request("a", prompt, max_tokens=6), _request("b", prompt, max_tokens=6)
    _run(sched, a, b)
    assert a.num_output_tokens == b.num_output_tokens == 6
    assert sched.kv_cache.num_free_blocks == 6
