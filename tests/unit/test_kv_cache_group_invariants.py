"""KV cache groups: how layers group, and the invariants of a pool shared by a full and a
sliding group under random interleavings with the prefix cache on (hollowed tree nodes,
hits that reuse only a window, preemption, aborts)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from heron.config import SchedulerConfig
from heron.engine.kv_cache import KVCacheManager
from heron.engine.request import Request, RequestStatus
from heron.engine.scheduler import Scheduler
from heron.models.kv_cache_spec import KVCacheGroups, cdiv, first_block_in_window
from heron.sampling_params import SamplingParams
from scheduler_steps import complete, schedule


def test_gemma3_layers_form_one_full_and_five_sliding_groups_of_three():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = KVCacheGroups.of(windows)
    assert [g.sliding_window for g in groups] == [None] + [512] * 5
    assert groups[0].layers == (5, 11, 17)
    assert groups[1].layers == (0, 1, 2) and groups[5].layers == (14, 15, 16)
    assert groups.group_size == 3 and groups.has_full
    slots = groups.slot_of_layer(18)
    assert {slots[layer] for layer in groups[0].layers} == {0, 1, 2}
    assert groups.group_of_layer(18)[11] == 0 and groups.group_of_layer(18)[12] == 4


def test_alike_layers_form_one_group():
    alike = KVCacheGroups.of([None] * 4)
    assert len(alike) == 1 and alike.has_full and alike[0].layers == (0, 1, 2, 3)
    sliding = KVCacheGroups.of([24] * 4)
    assert len(sliding) == 1 and sliding[0].is_sliding and not sliding.has_full


def test_capacity_counts_each_group_and_a_sliding_group_only_its_window():
    groups = KVCacheGroups.of([None, 8])
    # 40 tokens in blocks of 4: 10 full blocks; the sliding one holds 8 - 1 + 4 = 11 -> 3 + 1
    assert groups.blocks_for(40, 4, 4) == 10 + 4
    assert groups.max_tokens_in(14, 4, 4, limit=1000) == 40
    assert KVCacheGroups.of([8]).max_tokens_in(4, 4, 4, limit=1000) == 1000


class GroupedSchedulerMachine(RuleBasedStateMachine):
    """A scheduler over a full and a sliding group sharing a small pool, prefix cache on."""

    @initialize(window=st.sampled_from([3, 6, 9]), num_blocks=st.integers(16, 40),
                budget=st.sampled_from([4, 8, 16]))
    def setup(self, window, num_blocks, budget):
        self.bs = 4
        self.groups = KVCacheGroups.of([None, window])
        self.kv = KVCacheManager(num_blocks, self.bs, enable_prefix_caching=True,
                                 groups=self.groups)
        self.sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=3,
                                               kv_watermark=0.0), self.kv, max_model_len=40)
        self.rng = random.Random(num_blocks)
        self.next_id = 0

    @rule(prefix=st.sampled_from([0, 4, 8, 12]), extra=st.integers(1, 9),
          max_tokens=st.integers(1, 12))
    def add(self, prefix, extra, max_tokens):
        # shared prefixes (tokens 1..prefix) so that hits happen; the rest distinct
        prompt = list(range(1, prefix + 1)) + [100 + self.next_id * 10 + i for i in range(extra)]
        max_tokens = min(max_tokens, 40 - len(prompt))
        request = Request(str(self.next_id), prompt, SamplingParams(max_tokens=max_tokens),
                          max_tokens=max_tokens)
        self.next_id += 1
        self.sched.add(request)

    @rule()
    def step(self):
        if self.sched.has_unfinished():
            complete(self.sched, schedule(self.sched), lambda r: 7 + r.num_output_tokens % 3)

    @rule(index=st.integers(0, 5))
    def abort(self, index):
        live = list(self.sched.requests.values())
        if live:
            self.sched.finish(live[index % len(live)], RequestStatus.FINISHED_ABORTED)

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def pool_consistent(self):
        if not hasattr(self, "kv"):
            return
        pool, kv = self.kv.pool, self.kv
        owners = [0] * pool.num_blocks
        for request in self.sched.requests.values():
            for table in request.tables:
                for block in table.owned():
                    owners[block] += 1
        cached = {b for tree in kv.trees for b in tree.nodes}
        free = list(pool._free)
        assert len(free) == len(set(free))
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == owners[b], f"block {b}"
            assert (b in free) == (owners[b] == 0 and b not in cached), f"block {b}"
        unreferenced = sum(1 for b in cached if owners[b] == 0)
        assert sum(t.num_unreferenced for t in kv.trees) == unreferenced
        assert kv.num_free_blocks == len(free) + unreferenced

    @invariant()
    def tables_consistent(self):
        if not hasattr(self, "kv"):
            return
        window = self.groups[1].sliding_window
        budget = self.sched.config.max_num_batched_tokens
        for request in self.sched.running:
            full, sliding = request.tables
            assert len(full.block_ids) == len(sliding.block_ids) == \
                cdiv(request.num_computed_tokens, self.bs)
            assert full.num_released == 0
            # what the next query still reads is held
            first = first_block_in_window(request.num_computed_tokens, window, self.bs)
            assert sliding.num_released <= first
            assert len(sliding.owned()) <= cdiv(window - 1 + budget, self.bs) + 1
        for request in self.sched.waiting:
            assert all(t.block_ids == [] for t in request.tables)

    @invariant()
    def hollow_nodes_hold_no_block(self):
        if not hasattr(self, "kv"):
            return
        for tree in self.kv.trees:
            for block, node in tree.nodes.items():
                assert node.block_id == block and not node.is_hollow
                while not node.is_root:  # every cached block is reachable from its root
                    assert not node.detached and node.parent.children[node.tokens] is node
                    node = node.parent


GroupedSchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestGroupedScheduler = GroupedSchedulerMachine.TestCase
