"""KV-cache invariants under speculative decoding, driven without a model.

A fake worker plays a target whose true token at every position is ``truth(position)``: it
accepts each sequence's drafts while they equal the truth, then adds the true token (the
bonus), and proposes new drafts (some right, some wrong) for every sequence that sampled.
Random interleavings of add / step / speculate / abort / stop over small pools, with and
without lookahead slots (model drafts) and the prefix cache, must keep: no block leaked or
double-owned, only true tokens in any sequence, and no rejected token in the prefix cache.
"""

from __future__ import annotations

import itertools
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from heron.config import SchedulerConfig, SpeculativeConfig
from heron.engine.kv_cache import KVCacheManager, cdiv
from heron.engine.request import Request, RequestStatus
from heron.engine.scheduler import Scheduler
from heron.sampling_params import SamplingParams
from heron.worker.step import ModelRunnerOutput


def truth(position: int) -> int:
    return position * 7 % 5 + 1


def sequence_is_true(request: Request) -> bool:
    start = request.num_prompt_tokens
    return all(t == truth(start + i) for i, t in enumerate(request.output_token_ids))


class SpeculativeSchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), block_size=st.integers(1, 8),
                budget=st.integers(1, 48), max_num_seqs=st.integers(1, 6),
                k=st.integers(1, 4), lookahead=st.booleans(), prefix=st.booleans(),
                seed=st.integers(0, 2**16))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, k, lookahead, prefix, seed):
        spec = SpeculativeConfig(method="layer_skip" if lookahead else "ngram",
                                 num_speculative_tokens=k)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
        self.sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget,
                                               max_num_seqs=max_num_seqs), self.kv,
                               max_model_len=num_blocks * block_size, speculative=spec)
        self.capacity, self.k, self.lookahead = num_blocks * block_size, k, lookahead
        self.rng = random.Random(seed)
        self.live: list[Request] = []
        self.ids = itertools.count()

    def _sync(self) -> None:
        self.live = [r for r in self.live if not r.is_finished]

    def _drafts(self, request: Request) -> list[int]:
        """Up to k drafts after ``request``'s tokens: true ones, then maybe a wrong one."""
        n = self.rng.randint(0, self.k)
        right = self.rng.randint(0, n)
        drafts = [truth(request.num_tokens + i) for i in range(right)]
        return drafts + [truth(request.num_tokens + i) % 5 + 1 for i in range(right, n)]

    def _step(self) -> None:
        sched = self.sched
        out = sched.schedule()
        sampled, spec = [], {}
        for req_id, n in zip(out.req_ids, out.num_scheduled_tokens):
            request = sched.requests[req_id]
            drafts = out.spec_token_ids.get(req_id, [])
            assert not drafts or request.num_computed_tokens == request.num_tokens - 1
            assert n == request.num_tokens - request.num_computed_tokens + len(drafts) or \
                not drafts and n <= request.num_tokens - request.num_computed_tokens
            # blocks cover the step's tokens, and the lookahead of model drafts
            assert len(request.block_ids) >= cdiv(request.num_computed_tokens + n,
                                                  self.kv.block_size)
            if request.num_computed_tokens + n < request.num_tokens + len(drafts):
                sampled.append([])  # mid-prefill
                continue
            accepted = 0
            while accepted < len(drafts) and \
                    drafts[accepted] == truth(request.num_tokens + accepted):
                accepted += 1
            sampled.append(drafts[:accepted] + [truth(request.num_tokens + accepted)])
            if out.num_spec_tokens:
                spec[req_id] = self._drafts_after(request, sampled[-1])
        sched.update_from_output(out, ModelRunnerOutput(list(out.req_ids), sampled,
                                                        [None] * len(sampled), {}, spec))
        self._sync()

    def _drafts_after(self, request: Request, tokens: list[int]) -> list[int]:
        probe = Request("probe", request.prompt_token_ids + request.output_token_ids + tokens,
                        request.params)
        return self._drafts(probe)

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 20))
    def add(self, prompt_len, max_tokens):
        prompt_len = min(prompt_len, self.capacity - 1)
        max_tokens = min(max_tokens, self.capacity - prompt_len)
        prompt = [truth(p) for p in range(prompt_len)]  # shared prefixes hit the cache
        request = Request(f"r{next(self.ids)}", prompt, SamplingParams(max_tokens=max_tokens),
                          max_tokens=max_tokens)
        self.sched.add(request)
        self.live.append(request)

    @rule(n=st.integers(1, 6))
    def steps(self, n):
        for _ in range(n):
            self._step()

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def speculate(self, data):
        """A running decoder gets fresh drafts (as a worker's proposal would give it)."""
        request = data.draw(st.sampled_from(list(self.sched.running)))
        request.spec_token_ids = self._drafts(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        self.sched.finish(data.draw(st.sampled_from(self.live)), RequestStatus.FINISHED_ABORTED)
        self._sync()

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def stop(self, data):
        self.sched.finish(data.draw(st.sampled_from(list(self.sched.running))),
                          RequestStatus.FINISHED_STOPPED)
        self._sync()

    @invariant()
    def blocks_owned_once_and_never_leaked(self):
        pool, cache = self.kv.pool, self.kv.prefix_cache
        owners = [0] * pool.num_blocks
        for request in self.live:
            assert len(set(request.block_ids)) == len(request.block_ids)
            for b in request.block_ids:
                owners[b] += 1
        free = set(pool._free)
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == owners[b], f"block {b}"
            cached = cache is not None and cache.holds(b)
            assert (b in free) == (owners[b] == 0 and not cached), f"block {b}"

    @invariant()
    def only_true_tokens_reach_sequences_and_the_cache(self):
        bs = self.kv.block_size
        for request in self.live:
            assert sequence_is_true(request)
            assert request.num_computed_tokens < request.num_tokens
            node = request.last_cached_node
            for i in range(request.num_cached_blocks - 1, -1, -1):
                want = tuple(request.token_ids_between(i * bs, (i + 1) * bs))
                assert node.tokens == want, "a cached block holds a token not in the sequence"
                node = node.parent

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(sum(r.num_prompt_tokens + r.max_tokens for r in self.live) + 1):
            if not self.live:
                break
            self._step()
        assert not self.live
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(c == 0 for c in self.kv.pool.ref_counts)


SpeculativeSchedulerMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSpeculativeSchedulerInvariants = SpeculativeSchedulerMachine.TestCase
