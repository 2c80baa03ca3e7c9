"""Token-budget continuous batching with chunked prefill and preemption by recompute.

Every step has a budget of ``max_num_batched_tokens``. Running requests are served first
(a decode needs 1 token, an unfinished prefill the rest of its prompt, chunked to the budget),
then waiting requests are admitted in policy order (FCFS, or longest cached prefix first with
a fairness cap) while budget, sequence slots and KV blocks last. Prefill, chunked prefill,
prefix-cache hits and decode are the same rule: ``num_computed_tokens`` catches up with
``num_tokens`` (a hit starts it at the cached length). When the pool runs dry the youngest
running request is preempted (its blocks released, its progress reset) and goes back to the
front of the waiting queue.

``schedule()`` returns the step as plain data (``heron.worker.step.SchedulerOutput``: each
sequence described once, then only what changed); ``update_from_output()`` is the one place a
step's outcome is applied: progress, rollback of rejected speculative tokens, full blocks
offered to the prefix cache (never a rejected token), sampled tokens appended, token stops (EOS,
stop token ids, max tokens, context length). It returns each progressed sequence's
``SequenceDelta``.

Speculative decoding adds no rule: a decoding sequence's drafts (``Request.spec_token_ids``,
drafted by the worker after its last step) are more tokens for it to compute, so a step
schedules ``1 + len(drafts)`` of them within the same token budget, alongside others'
prefills and decodes. With model-based drafts every sequence that samples also gets KV room
for ``num_speculative_tokens`` lookahead positions, where the worker's draft writes the KV
of the tokens it drafts. The worker returns the accepted drafts plus one bonus token; the
rejected ones are rolled back from ``num_computed_tokens`` before any block is cached.

A request whose own bookkeeping raises (a lookup, an allocation, caching its blocks, its
outcome) is finished with status ``FINISHED_ERROR`` and queued in ``take_failed()``; the step
goes on for everyone else.

With pipeline parallelism several steps are in flight (``micro_batches``): each step takes
at most its share of the running sequences, a sequence in a step still in flight is neither
scheduled again nor preempted, and its progress is applied when that step's outcome arrives
(so ``num_computed_tokens`` always counts computed KV).

A waiting request whose next uncached block is being computed right now by a running prefill
(``n > 1`` siblings, users sharing a system prompt) is deferred a step, so it reuses that
block instead of computing it again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from heron.config import SchedulerConfig, SpeculativeConfig
from heron.engine.core_outputs import SequenceDelta
from heron.engine.kv_cache import KVCacheManager, PrefixHit
from heron.engine.request import Request, RequestStatus
from heron.engine.sequence_deltas import sequence_delta
from heron.engine.stats import SchedulerStats
from heron.speculative.stats import SpecDecodingStats
from heron.worker.step import ModelRunnerOutput, NewRequest, SchedulerOutput, num_rejected

logger = logging.getLogger(__name__)

LPM_WINDOW = 128  # longest-prefix-match ranks at most this many waiting requests per step


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens
    drafts: list[int] = field(default_factory=list)  # the last len(drafts) of those tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so it samples."""
        request = self.request
        return request.num_computed_tokens + self.num_tokens == \
            request.num_tokens + len(self.drafts)


@dataclass
class _Step:
    """A step while it is being scheduled (core side, with the request objects)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Decides which requests run each step and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 max_model_len: int, micro_batches: int = 1,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.config = config
        self.speculative = speculative
        self.spec_stats = SpecDecodingStats()
        paths = speculative.tree_paths if speculative else None
        self._tree_nodes = len(paths) if paths else None  # drafts verify as one tree
        self._num_spec = 0  # tokens the worker drafts after this step (0: not speculating)
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        # Pipeline parallelism keeps up to ``micro_batches`` steps in flight: each takes at
        # most its share of the running sequences (so the next step has some to run), and
        # the worker learns sampled tokens from the steps (not every rank samples).
        self.micro_batches = micro_batches
        self._step_ids = itertools.count(1)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished sequence, by id
        self.stats = SchedulerStats()
        self._failed: list[tuple[Request, Exception]] = []  # since the last take_failed()
        self._finished_ids: list[str] = []  # the worker still holds these: tell it next step

    # ---- queue management -------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate sequence id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def take_failed(self) -> list[tuple[Request, Exception]]:
        """Sequences failed (FINISHED_ERROR) since the last call, with what they raised."""
        failed, self._failed = self._failed, []
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove ``request`` from whichever queue holds it and free its blocks."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.finish_time = time.monotonic()
        self.requests.pop(request.request_id, None)
        if request.worker_knows:
            self._finished_ids.append(request.request_id)
        self.kv_cache.free(request)

    def fail(self, request: Request, exc: Exception) -> None:
        """Finish ``request`` with FINISHED_ERROR after its processing raised ``exc``."""
        logger.error("request %s failed: %r", request.request_id, exc,
                     exc_info=(type(exc), exc, exc.__traceback__))
        if request.is_finished:
            return
        try:
            self.finish(request, RequestStatus.FINISHED_ERROR)
        except Exception:  # noqa: BLE001 - its blocks may be what is broken
            logger.exception("freeing failed request %s", request.request_id)
            request.status = RequestStatus.FINISHED_ERROR
            self.requests.pop(request.request_id, None)
        self._failed.append((request, exc))

    # ---- the step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _Step()
        self._num_spec = self._spec_tokens_this_step()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(step, budget)
        if not step.preempted:
            self._schedule_waiting(step, budget)
        self.stats.num_steps += 1
        if step.scheduled:
            self.stats.step_tokens.observe(sum(s.num_tokens for s in step.scheduled))
        for s in step.scheduled:
            s.request.in_flight = True
        return self._message(step)

    def _message(self, step: _Step) -> SchedulerOutput:
        """The step as plain data: new sequences in full, known ones by what changed."""
        out = SchedulerOutput([s.request.request_id for s in step.scheduled],
                              [s.num_tokens for s in step.scheduled], next(self._step_ids),
                              preempted_req_ids=[r.request_id for r in step.preempted],
                              finished_req_ids=self._finished_ids,
                              num_spec_tokens=self._num_spec)
        self._finished_ids = []
        cached = out.cached
        for s in step.scheduled:
            request = s.request
            if s.drafts:
                out.spec_token_ids[request.request_id] = s.drafts
            if not request.worker_knows:
                out.new_requests.append(_new_request(request))
            else:
                kept = request.num_blocks_sent  # 0 when it resumes after preemption
                cached.req_ids.append(request.request_id)
                cached.num_kept_blocks.append(kept)
                cached.new_block_ids.append([t.block_ids[kept:] for t in request.tables])
                cached.num_computed_tokens.append(request.num_computed_tokens)
                if self.micro_batches > 1:
                    cached.new_token_ids.append(
                        request.output_token_ids[request.num_output_sent:])
            request.num_output_sent = request.num_output_tokens
            request.worker_knows = True
            request.num_blocks_sent = len(request.block_ids)
        return out

    def _schedule_running(self, out: _Step, budget: int) -> int:
        i = 0
        seats = -(-len(self.running) // self.micro_batches)  # this step's share
        while i < len(self.running) and budget > 0 and len(out.scheduled) < seats:
            request = self.running[i]
            if request.in_flight:
                i += 1
                continue
            drafts = self._drafts_to_verify(request, budget)
            num_tokens = min(request.num_tokens - request.num_computed_tokens + len(drafts),
                             budget)
            if num_tokens <= 0:
                i += 1
                continue
            try:
                allocated = self._allocate_lookahead(request, num_tokens) or \
                    self._allocate_running(request, num_tokens, out)
            except Exception as exc:  # noqa: BLE001 - this request's bookkeeping broke
                self.fail(request, exc)
                continue  # it left self.running: index i is the next request now
            if not allocated or request.status != RequestStatus.RUNNING:
                break  # preempted itself (nothing younger is left to serve), or must wait
            out.scheduled.append(ScheduledRequest(request, num_tokens, drafts))
            budget -= num_tokens
            i += 1
        return budget

    # ---- speculative decoding ------------------------------------------------------------
    def _spec_tokens_this_step(self) -> int:
        """Drafts per sequence the worker proposes after this step: 0 without speculation,
        or when the batch is large enough to be compute bound (``disable_by_batch_size``)."""
        spec = self.speculative
        if spec is None or self.micro_batches > 1:
            return 0
        if spec.disable_by_batch_size is not None and \
                len(self.running) >= spec.disable_by_batch_size:
            return 0
        return spec.num_speculative_tokens

    def _drafts_to_verify(self, request: Request, budget: int) -> list[int]:
        """The drafts ``request`` verifies this step (taking them: they are used once): only
        while decoding, and no more than the budget, max_tokens and the context leave room
        for (each accepted draft and the bonus token is one more output token)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or not self._num_spec or \
                request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        if self._tree_nodes is not None:  # a tree verifies whole or not at all
            return drafts if room >= len(drafts) else []
        return drafts[:max(0, room)]

    def _lookahead(self, end: int) -> int:
        """KV slots past position ``end`` (where this step's tokens stop) in which a model
        draft writes the KV of the tokens it drafts (bounded by the context)."""
        if not self._num_spec or not self.speculative.writes_draft_kv:
            return 0
        return max(0, min(self._num_spec, self.max_model_len - end))

    def _allocate_lookahead(self, request: Request, num_tokens: int) -> bool:
        """Blocks for the step's tokens plus the draft's lookahead, if the pool has them
        without preempting anyone (drafting room never costs a sequence its KV; without
        it the worker does not draft for this sequence)."""
        lookahead = self._lookahead(request.num_computed_tokens + num_tokens)
        return lookahead > 0 and \
            self.kv_cache.allocate(request, num_tokens + lookahead) is not None

    def _allocate_running(self, request: Request, num_tokens: int, out: _Step) -> bool:
        """Blocks for ``num_tokens`` more tokens, preempting the youngest (not in flight)
        until they fit; False if nothing is left to preempt."""
        while self.kv_cache.allocate(request, num_tokens) is None:
            victim = next((r for r in reversed(self.running) if not r.in_flight), None)
            if victim is None:
                return False  # every younger request is in flight: wait for their outcomes
            self._preempt(victim, out)
            if victim is request:
                return True
        return True

    def _schedule_waiting(self, out: _Step, budget: int) -> None:
        if not self._has_room(budget):
            return  # before any lookup: a full step costs no prefix-cache walk
        in_flight = self._blocks_in_flight()
        for request in self._waiting_in_order():
            try:
                num_tokens = self._try_admit(request, budget, in_flight)
            except Exception as exc:  # noqa: BLE001 - this request's bookkeeping broke
                self.fail(request, exc)
                continue
            if num_tokens is None:
                break  # the head waits for blocks, nobody overtakes it
            if num_tokens == 0:
                continue  # deferred: a running prefill is computing its next block
            out.scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
            if not self._has_room(budget):
                break
            in_flight.add(self.kv_cache.uncached_block_hash(request))

    def _try_admit(self, request: Request, budget: int, in_flight: set) -> int | None:
        """Admit ``request`` with its prefix hit: the tokens it computes this step, 0 if it
        is deferred, None if the pool (or the watermark) cannot take it now."""
        hit = self.kv_cache.lookup(request)
        next_block = self.kv_cache.uncached_block_hash(request, hit)
        if next_block is not None and next_block in in_flight:
            return 0
        num_cached = len(hit) * self.kv_cache.block_size
        num_tokens = min(request.num_tokens - num_cached, budget)
        if self._below_watermark(request, num_tokens, hit):
            return None
        # with the lookahead slots of a draft when this chunk ends the prompt (so it samples)
        # and the pool has them; else without
        lookahead = self._lookahead(num_cached + num_tokens) if \
            num_cached + num_tokens == request.num_tokens else 0
        with_lookahead = lookahead and \
            self.kv_cache.allocate(request, num_tokens + lookahead, hit) is not None
        if not with_lookahead and self.kv_cache.allocate(request, num_tokens, hit) is None:
            return None
        self._admit(request, num_cached)
        return num_tokens

    def _has_room(self, budget: int) -> bool:
        """Budget and a sequence slot are left for one more admission."""
        return budget > 0 and len(self.running) < self.config.max_num_seqs

    def _waiting_in_order(self) -> Iterator[Request]:
        """Waiting requests in admission order (each is looked up again when admitted:
        admitting the previous candidate may have evicted blocks)."""
        if self.config.policy == "fcfs" or self.kv_cache.prefix_cache is None:
            yield from list(self.waiting)
            return
        window = list(itertools.islice(self.waiting, LPM_WINDOW))
        hits = [self._hit_length(r) for r in window]

        def rank(i: int) -> tuple[int, int, int]:
            if window[i].num_overtakes >= self.config.max_overtakes:
                return (0, 0, i)  # overtaken too often: goes first, in arrival order
            return (1, -hits[i], i)  # then longest cached prefix first

        for i in sorted(range(len(window)), key=rank):
            yield window[i]

    def _hit_length(self, request: Request) -> int:
        """Cached blocks of ``request``'s prefix, for ranking (0 if the lookup fails: its
        admission attempt then reports the failure)."""
        try:
            return len(self.kv_cache.lookup(request))
        except Exception:  # noqa: BLE001
            return 0

    def _admit(self, request: Request, num_cached: int) -> None:
        for older in self.waiting:
            if older is request:
                break
            older.num_overtakes += 1
        self.waiting.remove(request)
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
        self.kv_cache.record_lookup(request.num_tokens, num_cached)
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
            self.stats.queue_time.observe(max(0.0, request.scheduled_time - request.arrival_time))
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _blocks_in_flight(self) -> set[int | None]:
        """Hashes of the blocks that running prefills will cache next."""
        return {self.kv_cache.uncached_block_hash(r) for r in self.running
                if r.num_computed_tokens < r.num_tokens - 1}

    def _below_watermark(self, request: Request, num_tokens: int, hit: PrefixHit) -> bool:
        """Admitting ``request`` would leave fewer free blocks than the watermark, while
        others are running (an idle engine always admits, so nothing waits forever)."""
        if not self.running:
            return False
        watermark = int(self.config.kv_watermark * self.kv_cache.num_blocks)
        needed = self.kv_cache.blocks_to_admit(request, num_tokens, hit)
        return self.kv_cache.num_free_blocks - needed < watermark

    def _preempt(self, request: Request, out: _Step) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        request.num_blocks_sent = 0  # it comes back with a whole new table
        request.spec_token_ids = []  # drafted against KV that is gone
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1
        out.preempted.append(request)

    # ---- the step's outcome -------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput
                           ) -> list[SequenceDelta]:
        """Apply what the worker computed and sampled; returns the delta of every sequence
        that gained tokens or finished. ``result`` may cover only part of ``out`` (the rest
        failed and was failed already)."""
        num_tokens = dict(zip(out.req_ids, out.num_scheduled_tokens))
        drafts = out.spec_token_ids
        for req_id in out.req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                request.in_flight = False
        now = time.monotonic()
        deltas = []
        for i, req_id in enumerate(result.req_ids):
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted or failed meanwhile
            try:
                delta = self._apply_outcome(request, num_tokens[req_id],
                                            drafts.get(req_id, ()), result, i, now)
            except Exception as exc:  # noqa: BLE001 - this request's bookkeeping broke
                self.fail(request, exc)
                continue
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _apply_outcome(self, request: Request, num_scheduled: int, drafts: list[int],
                       result: ModelRunnerOutput, i: int, now: float) -> SequenceDelta | None:
        if request.num_output_tokens == 0 or \
                request.num_computed_tokens < request.num_tokens - 1:
            self.stats.num_prefill_tokens += num_scheduled  # prompt, or recompute
        tokens = result.sampled_token_ids[i]
        start = request.num_computed_tokens
        request.num_computed_tokens += num_scheduled - num_rejected(drafts, tokens)
        self.kv_cache.cache_full_blocks(request)  # computed tokens only: never a rejected one
        prompt_lps = result.prompt_logprobs.get(request.request_id)
        if prompt_lps:
            request.prompt_logprobs[start + 1:start + 1 + len(prompt_lps)] = prompt_lps
        if drafts:
            self.spec_stats.observe(len(drafts), max(0, len(tokens) - 1))
        if not tokens:
            return None  # mid-prefill chunk
        logprobs = result.logprobs[i]
        accepted = 0
        for token in tokens:
            self._append_token(request, token, now)
            accepted += 1
            if request.is_finished:
                break
        if not request.is_finished:
            if drafts:  # the blocks of its accepted drafts, now that it holds them
                self.kv_cache.cache_full_blocks(request)
            request.spec_token_ids = result.spec_token_ids.get(request.request_id, [])
        return sequence_delta(request, tokens[:accepted],
                              logprobs[:accepted] if logprobs else None)

    def _append_token(self, request: Request, token: int, now: float) -> None:
        request.output_token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        status = self._token_stop(request, token)
        if status is not None:
            self.finish(request, status)

    def _token_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or \
                request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _new_request(request: Request) -> NewRequest:
    return NewRequest(request.request_id, request.prompt_token_ids,
                      request.params, [list(t.block_ids) for t in request.tables],
                      request.num_computed_tokens, list(request.eos_token_ids),
                      request.generator_seed)
