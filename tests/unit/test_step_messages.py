"""The plain-data step messages are all a worker needs: replayed through msgpack into a worker's
``InputBatch``, every ``SchedulerOutput`` of a run (chunked prefill, prefix-cache hits,
preemption, aborts) leaves the worker with the core's view of each scheduled sequence: its
block table, its progress, its tokens, the tokens it feeds this step, where their KV goes, and
which sequences sample.

The worker is the real ``InputBatch``; the model is a fake one that samples a token per
sequence whose step samples (``scheduler_steps.fake_output``), appended on both sides.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from heron.config import SchedulerConfig
from heron.engine.kv_cache import UNIFORM, KVCacheManager
from heron.engine.request import Request, RequestStatus
from heron.engine.scheduler import Scheduler
from heron.sampling_params import SamplingParams
from heron.models.kv_cache_spec import KVCacheGroups
from heron.worker.input_batch import InputBatch
from heron.worker.step import ModelRunnerOutput, SchedulerOutput
from scheduler_steps import StepView, fake_output, schedule


class MirroredEngine:
    """A scheduler and a worker batch fed only by the step messages, checked against each
    other every step."""

    def __init__(self, num_blocks: int, block_size: int, budget: int, max_num_seqs: int,
                 max_model_len: int, groups: KVCacheGroups = UNIFORM, **config) -> None:
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True,
                                 groups=groups)
        self.sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget,
                                               max_num_seqs=max_num_seqs, **config),
                               self.kv, max_model_len)
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, len(groups))
        self.messages: list[SchedulerOutput] = []
        self.samples: list[list[bool]] = []  # per step, per scheduled sequence

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens),
                      max_tokens=max_tokens)
        self.sched.add(req)
        return req

    def step(self, token) -> StepView:
        sched, batch = self.sched, self.batch
        view = schedule(sched)
        out = view.message
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
        assert wire == out, "the step does not survive msgpack"
        self.messages.append(wire)
        batch.update(wire)

        # the worker holds exactly the sequences it was told about and not told finished
        assert set(batch.states) == {rid for rid, r in sched.requests.items()
                                     if r.worker_knows}
        for req in view.preempted:  # kept (tokens, generator), without a row or blocks
            assert batch.states[req.request_id].row == -1
        rows = [s.row for s in batch.states.values() if s.row >= 0]
        assert len(rows) == len(set(rows)) <= len(sched.running), "rows beyond running ones"
        if not out.is_empty:
            self._check_batch(view, wire)

        self.samples.append([s.samples for s in view.scheduled])  # (before the update)
        result = fake_output(view, token)
        result = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=ModelRunnerOutput)
        batch.advance(wire.req_ids, wire.num_scheduled_tokens, result.sampled_token_ids)
        sched.update_from_output(out, result)
        for req in view.scheduled:  # the worker's copy of each sequence kept up
            state = batch.states[req.request.request_id]
            assert state.output_token_ids == req.request.output_token_ids
        return view

    def _check_batch(self, view: StepView, wire: SchedulerOutput) -> None:
        batch, bs = self.batch, self.bs
        host = batch.host_batch(wire.req_ids, wire.num_scheduled_tokens)
        qsl = host.query_start_loc_cpu
        for i, s in enumerate(view.scheduled):
            req, n = s.request, s.num_tokens
            state = batch.states[req.request_id]
            row = state.row
            start = req.num_computed_tokens
            where = f"{req.request_id} (step {len(self.messages)})"
            for g, table in enumerate(req.tables):
                assert batch.block_table[g, row, :batch.num_blocks[row]].tolist() == \
                    table.block_ids, f"{where}: the worker's block table {g} is not the core's"
            assert state.num_computed_tokens == start, where
            assert state.all_token_ids() == req.all_token_ids(), where
            assert batch.token_ids[row, :batch.num_tokens[row]].tolist() == req.all_token_ids()
            positions = range(start, start + n)
            assert host.input_ids[qsl[i]:qsl[i + 1]].tolist() == \
                req.token_ids_between(start, start + n), where
            assert host.positions[qsl[i]:qsl[i + 1]].tolist() == list(positions), where
            for g, table in enumerate(req.tables):
                assert host.slot_mapping[g, qsl[i]:qsl[i + 1]].tolist() == \
                    [table.block_ids[p // bs] * bs + p % bs for p in positions], where
                assert positions[0] // bs >= table.num_released, \
                    f"{where}: a query's block {g} was released"
            assert host.seq_lens_cpu[i] == start + n
        assert host.sample_rows == [qsl[i + 1] - 1 for i, s in enumerate(view.scheduled)
                                    if s.samples], "the sampled rows are not the sampling steps"


def _distinct_token(request: Request) -> int:
    """A token that differs across requests and steps (no two sequences grow identical
    blocks, so the prefix cache never swaps a block under a sequence)."""
    return 1000 + 50 * int(request.request_id[1:]) + request.num_output_tokens


# a full-attention layer and a sliding one (window 6 tokens: under two blocks of 4)
FULL_AND_SLIDING = KVCacheGroups.of([None, 6])


@pytest.mark.parametrize("groups,num_blocks", [(UNIFORM, 14), (FULL_AND_SLIDING, 22)],
                         ids=["one-group", "full-and-sliding"])
def test_worker_view_matches_the_core_over_chunked_prefill_prefix_hits_and_preemption(
        groups, num_blocks):
    eng = MirroredEngine(num_blocks=num_blocks, block_size=4, budget=16, max_num_seqs=4,
                         max_model_len=56, groups=groups, kv_watermark=0.0)
    system = list(range(100, 120))  # 20 tokens: 5 full blocks, once warm
    warm = eng.add("r0", system + [1], max_tokens=2)
    for _ in range(10):
        if not eng.sched.has_unfinished():
            break
        eng.step(_distinct_token)
    assert warm.status == RequestStatus.FINISHED_LENGTH
    reqs = [eng.add("r1", system + [2, 3, 4], max_tokens=10),  # hits the 5 system blocks
            eng.add("r2", list(range(200, 226)), max_tokens=10),  # chunked: 26 > 16
            eng.add("r3", system[:12] + [5, 6], max_tokens=12),  # hits 3 blocks
            eng.add("r4", list(range(300, 310)), max_tokens=12)]
    for _ in range(200):
        if not eng.sched.has_unfinished():
            break
        if reqs[3].num_output_tokens == 2 and not reqs[3].is_finished:
            eng.sched.finish(reqs[3], RequestStatus.FINISHED_ABORTED)  # told next step
        eng.step(_distinct_token)
    assert not eng.sched.has_unfinished()
    # the run covered what the messages have to describe
    assert any(not f for flags in eng.samples for f in flags), "no chunked prefill"
    assert any(new.num_computed_tokens > 0 for m in eng.messages for new in m.new_requests), \
        "no prefix hit"
    assert eng.sched.stats.num_preemptions > 0, "no preemption"
    assert any(0 in m.cached.num_kept_blocks for m in eng.messages), "no resumption"
    assert reqs[3].request_id in itertools.chain.from_iterable(
        m.finished_req_ids for m in eng.messages), "the abort never reached the worker"
    assert [r.status for r in reqs] == [RequestStatus.FINISHED_LENGTH] * 3 + [
        RequestStatus.FINISHED_ABORTED]
    eng.step(_distinct_token)  # the last finishes reach the worker
    assert len(eng.batch) == 0 and len(eng.batch.free_rows) == 4


# ---- two gaps this replay found (both mended) ---------------------------------------------------
def test_a_block_switched_to_its_cached_twin_reaches_the_worker():
    """KVCacheManager.cache_full_blocks switches a sequence's block to an identical cached
    twin and frees its own: the next step must resend the table from that block on."""
    # r1 repeats r0's block-aligned prompt: its hit stops a block short (one token is left to
    # compute), so r1 recomputes r0's last prompt block, cached meanwhile, and is switched to
    # r0's copy after the step; the worker still has r1's own (now free) block in that slot
    eng = MirroredEngine(num_blocks=8, block_size=4, budget=64, max_num_seqs=4, max_model_len=32)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    eng.add("r0", prompt, max_tokens=4)
    eng.add("r1", prompt, max_tokens=4)
    for _ in range(8):
        eng.step(lambda request: 7)
    assert any(0 < k < 2 for m in eng.messages for k in m.cached.num_kept_blocks), \
        "the swapped block was never resent"


def test_preempted_sequences_overtaken_by_admissions_fit_the_worker_batch():
    """A preempted sequence gives up its worker row while it waits (only running sequences
    count against max_num_seqs); younger admissions that overtake it (lpm ranks them ahead)
    must fit."""
    eng = MirroredEngine(num_blocks=5, block_size=2, budget=32, max_num_seqs=2,
                         max_model_len=10, policy="lpm", kv_watermark=0.0)
    system = [20, 21, 22, 23]
    eng.add("r1", system + [1], max_tokens=3)
    eng.add("r2", [40], max_tokens=5)
    for _ in range(3):  # r2 is preempted in the 3rd step, when r1 finishes
        eng.step(_distinct_token)
    assert eng.sched.stats.num_preemptions == 1 and set(eng.batch.states) == {"r1", "r2"}
    # longer cached prefixes than r2's: lpm admits both ahead of it
    eng.add("r3", system + [2], max_tokens=1)
    eng.add("r4", system + [3], max_tokens=1)
    for _ in range(12):
        if not eng.sched.has_unfinished():
            break
        eng.step(_distinct_token)
    assert not eng.sched.has_unfinished()


# ---- property-based: random interleavings ------------------------------------------------------
PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [5, 6, 7, 8, 2, 2, 3], [9] * 10)


class StepMessageMachine(RuleBasedStateMachine):
    """Random adds (shared prefixes, n > 1-like copies), steps and aborts over a small pool with
    the prefix cache on, the worker checked against the core every step.

    Here every prompt ends in a token of its own and admission is FCFS;
    ``TestStepMessagesAnyPrompts`` lifts both (repeated block-aligned prompts swap blocks
    for cached twins, lpm overtakes preempted sequences).
    """

    policies = ["fcfs"]
    own_last_token = True

    @initialize(num_blocks=st.integers(4, 24), block_size=st.integers(1, 4),
                budget=st.integers(1, 48), max_num_seqs=st.integers(1, 6), data=st.data())
    def setup(self, num_blocks, block_size, budget, max_num_seqs, data):
        policy = data.draw(st.sampled_from(self.policies))
        self.capacity = num_blocks * block_size
        self.eng = MirroredEngine(num_blocks, block_size, budget, max_num_seqs,
                                  max_model_len=self.capacity, policy=policy, max_overtakes=3)
        self.live: list[Request] = []
        self.ids = itertools.count()

    def _sync(self) -> None:
        self.live = [r for r in self.live if not r.is_finished]

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 12),
          suffix=st.lists(st.integers(2, 4), max_size=6), max_tokens=st.integers(1, 8),
          copies=st.integers(1, 3))
    def add(self, prefix, cut, suffix, max_tokens, copies):
        for _ in range(copies):
            i = next(self.ids)
            prompt = prefix[:cut] + suffix + ([10_000 + i] if self.own_last_token else [])
            prompt = prompt[-(self.capacity - 1):] or [3]
            self.live.append(self.eng.add(f"r{i}", prompt,
                                          min(max_tokens, self.capacity - len(prompt))))

    @rule(n=st.integers(1, 6))
    def steps(self, n):
        for _ in range(n):
            self.eng.step(_distinct_token)
        self._sync()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        self.eng.sched.finish(data.draw(st.sampled_from(self.live)),
                              RequestStatus.FINISHED_ABORTED)
        self._sync()

    def teardown(self):
        if not hasattr(self, "eng"):
            return
        bound = 4 * sum(r.num_tokens + r.max_tokens for r in self.live) + 8
        for _ in range(bound):
            if not self.eng.sched.has_unfinished():
                break
            self.eng.step(_distinct_token)
        assert not self.eng.sched.has_unfinished(), f"not drained in {bound} steps"
        self.eng.step(_distinct_token)  # the last finishes reach the worker
        assert len(self.eng.batch) == 0


StepMessageMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestStepMessages = StepMessageMachine.TestCase


class AnyPromptsMachine(StepMessageMachine):
    policies = ["fcfs", "lpm"]
    own_last_token = False


AnyPromptsMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestStepMessagesAnyPrompts = AnyPromptsMachine.TestCase
