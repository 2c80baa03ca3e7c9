"""Invariants of the paged KV cache and the scheduler, driven without a model.

The engine loop is simulated as ``EngineCore.step`` drives it (``tests/helpers/scheduler_steps.py``):
``schedule()`` returns the plain-data step, a fake worker (the model would run here) returns
one fake token for every scheduled sequence whose step ``samples`` (decided before the
update), and ``update_from_output()`` applies it: progress, the appended token and the length
stop at ``max_tokens``. Aborts and stops call ``Scheduler.finish`` between steps.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from heron.config import SchedulerConfig
from heron.engine.kv_cache import BlockPool, KVCacheManager, cdiv
from heron.engine.request import Request, RequestStatus
from heron.engine.scheduler import Scheduler
from heron.sampling_params import SamplingParams
from scheduler_steps import StepView, complete, schedule

FAKE_TOKEN = 7


# ---- helpers ---------------------------------------------------------------------------------
def make_scheduler(num_blocks: int, block_size: int, max_num_batched_tokens: int,
                   max_num_seqs: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    # the engine's max_model_len never exceeds the pool (requests keep prompt + max_tokens
    # within it, so their length stop is max_tokens)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                     max_num_seqs=max_num_seqs), kv,
                     max_model_len=num_blocks * block_size)


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens)


def fake_token(request: Request) -> int:
    return FAKE_TOKEN


def engine_step(sched: Scheduler) -> StepView:
    """One simulated engine iteration (schedule, fake worker, update_from_output: progress,
    the appended token, the length stop)."""
    out = schedule(sched)
    complete(sched, out, fake_token)
    return out


def check_pool(sched: Scheduler, live: list[Request], finished: list[Request]) -> None:
    """Every block is free xor owned; ref counts equal the number of live owners."""
    kv = sched.kv_cache
    pool = kv.pool
    free = list(pool._free)
    assert len(free) == len(set(free)), f"duplicate blocks in the free list: {free}"
    assert all(0 <= b < pool.num_blocks for b in free)
    owners = [0] * pool.num_blocks
    for req in live:
        assert len(req.block_ids) == len(set(req.block_ids)), \
            f"{req.request_id} holds a block twice: {req.block_ids}"
        for b in req.block_ids:
            assert 0 <= b < pool.num_blocks
            owners[b] += 1
    free_set = set(free)
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == owners[b], \
            f"block {b}: ref count {pool.ref_counts[b]} but {owners[b]} live owners"
        assert (b in free_set) == (owners[b] == 0), \
            f"block {b}: free={b in free_set}, owners={owners[b]}"
    owned = sum(1 for c in owners if c > 0)
    assert len(free) + owned == pool.num_blocks
    assert pool.num_free_blocks == len(free)
    for req in finished:
        assert req.is_finished
        assert req.block_ids == [], f"finished {req.request_id} still holds {req.block_ids}"


def check_queues(sched: Scheduler, live: list[Request]) -> None:
    """Between steps: queue membership, statuses and block-table sizes agree."""
    kv = sched.kv_cache
    running_ids = [id(r) for r in sched.running]
    waiting_ids = [id(r) for r in sched.waiting]
    assert len(set(running_ids)) == len(running_ids), "a request is running twice"
    assert len(set(waiting_ids)) == len(waiting_ids), "a request is waiting twice"
    assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
    assert set(running_ids) | set(waiting_ids) == {id(r) for r in live}
    assert len(sched.running) <= sched.config.max_num_seqs
    assert sched.has_unfinished() == bool(live)
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
        assert len(req.block_ids) == cdiv(req.num_computed_tokens, kv.block_size), \
            (req.request_id, req.num_computed_tokens, req.block_ids)
    for req in sched.waiting:
        assert req.status == RequestStatus.WAITING
        assert req.num_computed_tokens == 0
        assert req.block_ids == []
    for req in live:
        assert 0 <= req.num_computed_tokens <= req.num_tokens
        # between steps a live request always has at least one token left to compute
        assert req.num_computed_tokens < req.num_tokens
        assert req.num_output_tokens < req.max_tokens


# ---- property-based: random interleavings ------------------------------------------------------
class SchedulerMachine(RuleBasedStateMachine):
    """Random interleavings of add / step / abort / stop over a small pool."""

    @initialize(num_blocks=st.integers(4, 24), block_size=st.integers(1, 8),
                max_num_batched_tokens=st.integers(1, 64), max_num_seqs=st.integers(1, 6))
    def setup(self, num_blocks, block_size, max_num_batched_tokens, max_num_seqs):
        self.sched = make_scheduler(num_blocks, block_size, max_num_batched_tokens, max_num_seqs)
        self.capacity = num_blocks * block_size
        self.live: list[Request] = []
        self.finished: list[Request] = []
        self.ids = itertools.count()
        self.preemptions = 0

    # -- bookkeeping
    def _sync(self) -> None:
        still = []
        for req in self.live:
            (self.finished if req.is_finished else still).append(req)
        self.live = still

    def _step(self) -> StepView:
        sched = self.sched
        kv = sched.kv_cache
        before_running = list(sched.running)
        before_waiting = list(sched.waiting)
        remaining = {id(r): r.num_tokens - r.num_computed_tokens for r in self.live}

        out = schedule(sched)

        # per-step limits
        scheduled = [s.request for s in out.scheduled]
        assert len({id(r) for r in scheduled}) == len(scheduled), "scheduled twice in one step"
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        for s in out.scheduled:
            assert s.request.status == RequestStatus.RUNNING
            assert 1 <= s.num_tokens <= remaining[id(s.request)]
            # blocks now cover the tokens this step will write
            assert len(s.request.block_ids) == cdiv(s.request.num_computed_tokens + s.num_tokens,
                                                    kv.block_size)
        assert not {id(r) for r in scheduled} & {id(r) for r in out.preempted}
        # running requests not scheduled this step keep exactly what they had
        sched_ids = {id(r) for r in scheduled}
        for req in sched.running:
            if id(req) not in sched_ids:
                assert len(req.block_ids) == cdiv(req.num_computed_tokens, kv.block_size)

        # preemption: victims are the youngest running requests, requeued at the front
        k = len(out.preempted)
        if k:
            assert out.preempted == list(reversed(before_running[-k:]))
            assert list(sched.waiting)[:k] == before_running[-k:]
            assert list(sched.waiting)[k:] == before_waiting
            for req in out.preempted:
                assert req.status == RequestStatus.WAITING
                assert req.num_computed_tokens == 0 and req.block_ids == []
            # no admissions in a step that preempted
            assert all(any(r is b for b in before_running) for r in scheduled)
        # admissions are FCFS: the newly running requests are a prefix of the waiting queue
        admitted = [r for r in scheduled if not any(r is b for b in before_running)]
        assert admitted == before_waiting[:len(admitted)]
        assert list(sched.waiting)[k:] == before_waiting[len(admitted):]
        self.preemptions += k
        assert sched.stats.num_preemptions == self.preemptions

        # progress: with work pending, the oldest running request (or the waiting head, when
        # nothing runs) is always scheduled, so the engine can never spin on empty steps
        if self.live:
            head = before_running[0] if before_running else before_waiting[0]
            assert any(r is head for r in scheduled), "the head request made no progress"
        else:
            assert out.is_empty
        check_pool(sched, self.live, self.finished)

        sampling = {id(s.request) for s in out.scheduled if s.samples}  # before the update
        before = {id(s.request): (s.request.num_computed_tokens, s.request.num_output_tokens)
                  for s in out.scheduled}
        deltas = complete(sched, out, fake_token)
        assert len(deltas) == len(sampling), "one delta per sequence that sampled"
        for s in out.scheduled:
            req = s.request
            computed, outputs = before[id(req)]
            assert req.num_computed_tokens == computed + s.num_tokens
            assert req.num_computed_tokens <= req.num_tokens
            if id(req) in sampling:
                # it computed all its tokens, then gained exactly the fake one
                assert req.num_computed_tokens == req.num_tokens - 1
                assert req.num_output_tokens == outputs + 1
                assert req.output_token_ids[-1] == FAKE_TOKEN
                # finished exactly when it reached max_tokens
                if req.num_output_tokens >= req.max_tokens:
                    assert req.status == RequestStatus.FINISHED_LENGTH
                    assert req.block_ids == [] and req not in sched.running
                else:
                    assert req.status == RequestStatus.RUNNING
            else:
                assert req.num_output_tokens == outputs  # mid-prefill: no token
                assert req.status == RequestStatus.RUNNING
        self._sync()
        return out

    # -- rules
    @rule(prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 20))
    def add(self, prompt_len, max_tokens):
        # the engine's max_model_len never exceeds the pool: prompt + max_tokens <= capacity
        prompt_len = min(prompt_len, self.capacity - 1)
        max_tokens = min(max_tokens, self.capacity - prompt_len)
        req = make_request(f"r{next(self.ids)}", prompt_len, max_tokens)
        self.sched.add(req)
        self.live.append(req)

    @rule()
    def step(self):
        self._step()

    @rule(n=st.integers(2, 8))
    def steps(self, n):
        for _ in range(n):
            self._step()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self.live))
        self.sched.finish(req, RequestStatus.FINISHED_ABORTED)
        assert req.status == RequestStatus.FINISHED_ABORTED
        self._sync()

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def stop(self, data):
        req = data.draw(st.sampled_from(list(self.sched.running)))
        self.sched.finish(req, RequestStatus.FINISHED_STOPPED)
        self._sync()

    @rule()
    def drain(self):
        self._drain()

    def _drain(self):
        # the oldest running request is never preempted and advances >= 1 token a step,
        # so every request needs at most prompt + max_tokens steps as the head
        bound = sum(r.num_prompt_tokens + r.max_tokens for r in self.live)
        for _ in range(bound):
            if not self.live:
                break
            self._step()
        assert not self.live, f"{len(self.live)} requests left after {bound} steps"
        assert not self.sched.has_unfinished()
        pool = self.sched.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks
        assert all(c == 0 for c in pool.ref_counts)
        assert sorted(pool._free) == list(range(pool.num_blocks))

    # -- checked after every rule
    @invariant()
    def pool_consistent(self):
        check_pool(self.sched, self.live, self.finished)

    @invariant()
    def queues_consistent(self):
        check_queues(self.sched, self.live)

    def teardown(self):
        if hasattr(self, "sched"):
            self._drain()


SchedulerMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerInvariants = SchedulerMachine.TestCase


# ---- deterministic unit tests ------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 7, 32, 64, 100, 128])
def test_chunked_prefill_spreads_prompt_over_budget(budget):
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=budget,
                           max_num_seqs=4)
    req = make_request("a", 100, 5)
    sched.add(req)
    chunks = []
    while req.num_output_tokens == 0:
        out = engine_step(sched)
        assert [s.request for s in out.scheduled] == [req]
        chunks.append(out.scheduled[0].num_tokens)
        # no sample until the last chunk of the prompt
        assert req.num_output_tokens == (1 if req.num_computed_tokens == 100 else 0)
        assert len(req.block_ids) == cdiv(req.num_computed_tokens, 4)
    assert len(chunks) == -(-100 // budget)
    assert sum(chunks) == 100
    assert all(c == budget for c in chunks[:-1])
    # then one token per decode step
    out = engine_step(sched)
    assert out.scheduled[0].num_tokens == 1 and req.num_output_tokens == 2


def test_running_decodes_come_before_waiting_prefills():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                           max_num_seqs=4)
    a = make_request("a", 8, 10)
    sched.add(a)
    engine_step(sched)  # a prefilled, sampled its first token
    assert a.num_output_tokens == 1
    b = make_request("b", 40, 10)
    sched.add(b)
    out = schedule(sched)
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(a, 1), (b, 15)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    complete(sched, out, fake_token)
    assert a.num_output_tokens == 2 and b.num_output_tokens == 0
    # b's prefill is still a running request now; a's decode is still served first
    out = schedule(sched)
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(a, 1), (b, 15)]


def test_budget_limits_waiting_admission_and_max_num_seqs():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64,
                           max_num_seqs=2)
    reqs = [make_request(f"r{i}", 4, 3) for i in range(3)]
    for r in reqs:
        sched.add(r)
    out = schedule(sched)
    assert [s.request for s in out.scheduled] == reqs[:2]
    assert list(sched.waiting) == [reqs[2]]


def test_waiting_head_short_of_blocks_is_not_overtaken():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64,
                           max_num_seqs=4)
    a = make_request("a", 8, 4)
    sched.add(a)
    engine_step(sched)
    b = make_request("b", 12, 1)  # needs 3 blocks, only 1 left after a's decode
    c = make_request("c", 2, 1)  # would fit, but must not overtake b
    sched.add(b)
    sched.add(c)
    out = schedule(sched)
    assert [s.request for s in out.scheduled] == [a]
    assert list(sched.waiting) == [b, c]
    assert b.block_ids == [] and c.block_ids == []


def test_preemption_picks_youngest_and_requeues_it_first():
    # 4 blocks of 2 tokens; a and b each take 2 blocks for their 4-token prompts
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=64,
                           max_num_seqs=4)
    a = make_request("a", 4, 2)
    b = make_request("b", 4, 3)
    c = make_request("c", 2, 1)
    sched.add(a)
    sched.add(b)
    engine_step(sched)
    assert sched.running == [a, b]
    assert a.num_output_tokens == b.num_output_tokens == 1
    assert sched.kv_cache.pool.num_free_blocks == 0
    sched.add(c)
    b_blocks = list(b.block_ids)

    # a's decode needs a 3rd block: the pool is empty, so the youngest (b) is preempted
    out = schedule(sched)
    assert out.preempted == [b]
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(a, 1)]
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c]  # b goes back to the front, ahead of c
    assert b.status == RequestStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and sched.stats.num_preemptions == 1
    assert b.output_token_ids == [FAKE_TOKEN]  # tokens are kept, only the KV is dropped
    assert set(a.block_ids) & set(b_blocks)  # a reused one of b's blocks
    assert len(a.block_ids) == 3

    # a's 2nd token finishes it (max_tokens); b recomputes prompt + its output token, then c
    complete(sched, out, fake_token)
    assert a.output_token_ids == [FAKE_TOKEN] * 2
    assert a.status == RequestStatus.FINISHED_LENGTH and a.block_ids == []
    out = schedule(sched)
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(b, 5), (c, 2)]
    assert out.scheduled[0].samples


def test_preemption_frees_room_for_the_oldest():
    # block_size 1: every decode needs a new block; with the pool full the older request's
    # decode evicts the younger one rather than stalling
    sched = make_scheduler(num_blocks=4, block_size=1, max_num_batched_tokens=64,
                           max_num_seqs=4)
    a = make_request("a", 2, 2)
    b = make_request("b", 2, 2)
    sched.add(a)
    sched.add(b)
    engine_step(sched)
    assert sched.kv_cache.pool.num_free_blocks == 0
    out = schedule(sched)
    assert out.preempted == [b]
    assert [s.request for s in out.scheduled] == [a]


def test_finish_frees_blocks_from_any_queue():
    sched = make_scheduler(num_blocks=8, block_size=2, max_num_batched_tokens=64,
                           max_num_seqs=1)
    a = make_request("a", 5, 4)
    b = make_request("b", 3, 4)
    sched.add(a)
    sched.add(b)
    engine_step(sched)
    assert len(a.block_ids) == 3 and sched.kv_cache.pool.num_free_blocks == 5
    sched.finish(b, RequestStatus.FINISHED_ABORTED)  # waiting
    assert b not in sched.waiting and b.status == RequestStatus.FINISHED_ABORTED
    sched.finish(a, RequestStatus.FINISHED_ABORTED)  # running
    assert sched.running == [] and a.block_ids == []
    assert sched.kv_cache.pool.num_free_blocks == 8
    assert not sched.has_unfinished()
    assert sched.schedule().is_empty


def test_block_pool_double_release_asserts():
    pool = BlockPool(4)
    (b,) = pool.take(1)
    assert pool.ref_counts[b] == 1 and pool.num_free_blocks == 3
    pool.release(b)
    assert pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="double free"):
        pool.release(b)
    with pytest.raises(AssertionError, match="double free"):
        pool.release(3)  # never taken
    assert pool.num_free_blocks == 4 and sorted(pool._free) == [0, 1, 2, 3]


def test_block_pool_retain_and_take_limits():
    pool = BlockPool(3)
    blocks = pool.take(2)
    pool.retain(blocks[0])
    assert pool.release(blocks[0]) is False
    assert pool.ref_counts[blocks[0]] == 1 and pool.num_free_blocks == 1
    assert pool.release(blocks[0]) is True
    assert pool.num_free_blocks == 2
    # a cached block keeps out of the free list until the cache frees it
    assert pool.release(blocks[1], cached=True) is True
    assert pool.num_free_blocks == 2
    pool.free_block(blocks[1])
    assert pool.num_free_blocks == 3
    blocks = pool.take(1)
    with pytest.raises(AssertionError, match="in use"):
        pool.free_block(blocks[0])
    with pytest.raises(RuntimeError):
        pool.take(3)
    assert pool.num_free_blocks == 2


def test_allocate_changes_nothing_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", 8, 1)
    b = make_request("b", 8, 1)
    assert kv.allocate(a, 8) is not None and len(a.block_ids) == 2
    assert not kv.can_allocate(b, 8)
    assert kv.allocate(b, 8) is None
    assert b.block_ids == [] and kv.pool.num_free_blocks == 1
    kv.free(a)
    assert kv.pool.num_free_blocks == 3 and kv.usage == 0.0
