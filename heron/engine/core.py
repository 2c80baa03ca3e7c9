"""The engine core: scheduler + KV cache + executor. Token ids in, ``SequenceDelta``s out.

Loop of one ``step()``: schedule (plain-data step message) -> the executor runs it on the
worker -> ``Scheduler.update_from_output`` applies the outcome -> each sequence that progressed
yields its delta. Nothing here decodes text or copies a sequence's history: stop strings and
n > 1 grouping belong to ``output_processor.OutputProcessor``, which tells the core (through
``finish_sequence``) when a stop string ends a sequence.

A request whose processing raises is finished with finish_reason "error" (its n siblings too)
and the others go on; ``EngineFault`` when no request explains the failure.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from heron.config import EngineConfig
from heron.distributed.parallel_state import check_model_fits
from heron.engine.core_outputs import SequenceDelta
from heron.engine.isolation import EngineFault, describe, run_isolating
from heron.engine.kv_cache import KVCacheManager
from heron.engine.prefix_cache import PrefixCacheStats
from heron.engine.prompt_rules import check_prompt
from heron.engine.request import Request, RequestStatus
from heron.engine.scheduler import Scheduler
from heron.engine.sequence_deltas import sequence_delta
from heron.engine.stats import STEP_TIME_BUCKETS, EngineStats, Histogram, snapshot
from heron.executor import Executor, make_executor
from heron.loader.model_source import resolve_model
from heron.logging_config import startup_phase
from heron.models import ModelArchConfig, get_model_class
from heron.models.kv_cache_spec import kv_cache_groups
from heron.models.config import architecture_of
from heron.models.context_length import (check_max_model_len, check_streaming_kv,
                                         prefix_caching_allowed)
from heron.sampling_params import SamplingParams, child_seed
from heron.worker.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# A step fails as a whole when every request in it fails alone. That is an engine fault (not
# the requests') when they belong to different user requests, or when it happens this many
# steps in a row: a bad request (or its n siblings) fails once, a broken engine every time.
MAX_FAILED_STEPS = 3


def _eos_ids(source, arch: ModelArchConfig) -> tuple[int, ...]:
    eos = source.generation_config.get("eos_token_id")
    if eos is None:
        return arch.eos_token_ids
    return tuple(eos) if isinstance(eos, list) else (eos,)


class EngineCore:
    """Owns the scheduler, the KV cache and the executor of one model."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        started = time.monotonic()
        with startup_phase(logger, "model config", config.model or "embedded SmolLM2"):
            source = resolve_model(config.model, config.load_format, config.hf_overrides)
            get_model_class(architecture_of(source.hf_config))  # unsupported: fail early
            self.arch = ModelArchConfig.from_hf(source.hf_config)
            check_max_model_len(self.arch, config.max_model_len, config.cache.streaming_kv)
        self.model_name = source.name
        # where another process can load it from: --tokenizer's directory, else the model's
        self.tokenizer_dir = config.tokenizer or source.tokenizer_dir
        self.eos_token_ids = _eos_ids(source, self.arch)
        par, arch = config.parallel, self.arch
        check_model_fits(arch.num_heads, arch.num_kv_heads, arch.intermediate_size,
                         arch.num_layers, par.tensor_parallel_size, par.pipeline_parallel_size)
        self.executor = executor or make_executor(config, source)
        info = self.executor.info
        self.max_model_len = info.max_model_len
        self.kv_cache = KVCacheManager(info.num_kv_blocks, config.cache.block_size,
                                       prefix_caching_allowed(
                                           arch, config.cache.enable_prefix_caching),
                                       record_events=config.kv_events_endpoint is not None,
                                       groups=kv_cache_groups(self.arch))
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len,
                                   micro_batches=self.executor.max_in_flight,
                                   speculative=config.speculative)
        # pipeline parallelism: steps submitted and not yet applied, oldest first, and the
        # outcomes collected ahead of their turn (while isolating a failed step)
        self._in_flight: collections.deque[SchedulerOutput] = collections.deque()
        self._ready: dict[int, ModelRunnerOutput | Exception] = {}
        self.sequences: dict[str, list[Request]] = {}  # request id -> its n sequences
        self._failed_steps = 0  # consecutive steps in which every request failed
        # totals for stats(): requests accepted and refused, their prompt tokens, tokens
        # generated (every delta's), and the time of each step that ran a batch
        self._accepted = self._rejected = self._prompt_tokens = self._generated = 0
        self._step_time = Histogram.of(STEP_TIME_BUCKETS)
        self.quantization, self.weight_bytes = info.quantization, info.weight_bytes
        logger.info("heron engine core ready: %s (%s, %s, weights %s, %.1f MB, %s backend, %s "
                    "executor) with %d KV blocks x %d tokens in %.1fs", self.model_name,
                    self.arch.architecture, config.dtype, info.quantization,
                    info.weight_bytes / 1e6, info.attention_backend, config.executor_backend,
                    info.num_kv_blocks, config.cache.block_size, time.monotonic() - started)

    def shutdown(self) -> None:
        self.executor.shutdown()

    def check_health(self) -> None:
        """``EngineFault`` if a worker is gone: an idle core notices too."""
        self.executor.check_health()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Validate and queue the request's n sequences; ValueError (queueing nothing) for bad
        input. ``arrival_time`` (time.monotonic) defaults to now; requests share cached
        prefixes only with requests of the same ``cache_salt``."""
        try:
            self._add_request(request_id, prompt_token_ids, params, arrival_time, cache_salt)
        except Exception:
            self._rejected += 1
            raise
        self._accepted += 1
        self._prompt_tokens += len(prompt_token_ids)

    def _add_request(self, request_id, prompt_token_ids, params, arrival_time, cache_salt):
        if request_id in self.sequences:
            raise ValueError(f"duplicate request id {request_id!r}")
        token_ids = list(prompt_token_ids)
        params, cache_salt = self._with_streaming_kv(params, cache_salt)
        room = check_prompt(token_ids, params, self.max_model_len, self.arch.vocab_size)
        max_tokens = min(params.max_tokens or room, room)
        children = [self._child(request_id, i, token_ids, params, max_tokens)
                    for i in range(params.n)]
        for child in children:
            child.cache_salt = cache_salt
            if arrival_time is not None:
                child.arrival_time = arrival_time
            self.scheduler.add(child)
        self.sequences[request_id] = children

    def _with_streaming_kv(self, params: SamplingParams, cache_salt: str | None):
        """The request's StreamingLLM cache (its own, else --streaming-kv), checked against
        the model; such a request caches its blocks apart (deep layers' KV past the window
        differ from a whole-context request's)."""
        streaming = params.streaming_kv or self.config.cache.streaming_kv
        if streaming is None:
            return params, cache_salt
        if self.config.parallel.context_parallel_size > 1:
            raise ValueError("streaming_kv (StreamingLLM) is not supported with context "
                             "parallelism (--context-parallel-size > 1)")
        check_streaming_kv(self.arch, streaming)
        salt = f"{cache_salt or ''}\x00streaming-kv {streaming[0]},{streaming[1]}"
        return dataclasses.replace(params, streaming_kv=streaming), salt

    def _child(self, request_id, index, token_ids, params, max_tokens) -> Request:
        seed = None
        if params.seed is not None:
            seed = params.seed if index == 0 else child_seed(params.seed, index)
        return Request(request_id if params.n == 1 else f"{request_id}#{index}", token_ids,
                       params, eos_token_ids=self.eos_token_ids, max_tokens=max_tokens,
                       parent_id=request_id, index=index, generator_seed=seed)

    def abort_request(self, request_id: str) -> list[SequenceDelta]:
        """Finish every unfinished sequence of the request with "abort"; their final deltas."""
        children = self.sequences.pop(request_id, None)
        if children is None:
            return []
        deltas = []
        for child in children:
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                deltas.append(sequence_delta(child, []))
        return deltas

    def finish_sequence(self, request_id: str, index: int, stop_reason: str | int) -> None:
        """A stop string (found downstream) ended sequence ``index``: free it, emit nothing."""
        children = self.sequences.get(request_id)
        if children is None or not 0 <= index < len(children):
            return
        child = children[index]
        if not child.is_finished:
            child.stop_reason = stop_reason
            self.scheduler.finish(child, RequestStatus.FINISHED_STOPPED)
        if all(c.is_finished for c in children):
            del self.sequences[request_id]

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or submitted steps whose outcomes are still to be applied."""
        return bool(self.sequences or self._in_flight)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.sequences)

    def reset_prefix_cache(self) -> int:
        """Free every cached KV block no request is using; returns how many were freed."""
        freed = self.kv_cache.reset_prefix_cache()
        logger.info("prefix cache reset: %d blocks freed", freed)
        return freed

    def take_kv_events(self) -> list:
        """KV events (blocks stored / removed) since the last call; empty unless recorded."""
        cache = self.kv_cache.prefix_cache
        return cache.take_events() if cache is not None else []

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        """One iteration; the deltas of the sequences that progressed, finished or failed."""
        began = time.perf_counter()
        pipelined = self.executor.max_in_flight > 1
        ran, deltas = self._pipelined_step() if pipelined else self._single_step()
        if ran:
            self._step_time.observe(time.perf_counter() - began)
        self._generated += sum(len(d.new_token_ids) for d in deltas)
        return deltas

    def _single_step(self) -> tuple[bool, list[SequenceDelta]]:
        """(whether a step computed tokens, its deltas)."""
        sched = self.scheduler.schedule()
        deltas = self._fail_groups(self.scheduler.take_failed())
        if sched.is_empty and not (sched.finished_req_ids or sched.preempted_req_ids):
            return False, self._forget_finished(deltas)
        result = self._execute(sched)
        deltas += self.scheduler.update_from_output(sched, result)
        deltas += self._fail_groups(self.scheduler.take_failed())
        return not sched.is_empty, self._forget_finished(deltas)

    def _pipelined_step(self) -> tuple[bool, list[SequenceDelta]]:
        """Pipeline parallelism: submit a new step while fewer than ``max_in_flight`` run;
        apply the oldest step's outcome when the pipe is full or nothing new could start.
        (A sequence is in at most one step in flight, so steps never wait on each other.)
        Returns (whether a step that computes tokens was submitted or applied, the deltas)."""
        deltas = []
        started = applied = False
        if self.executor.num_in_flight < self.executor.max_in_flight:
            sched = self.scheduler.schedule()
            deltas += self._fail_groups(self.scheduler.take_failed())
            if not sched.is_empty or sched.finished_req_ids or sched.preempted_req_ids:
                self.executor.submit(sched)
                self._in_flight.append(sched)
                started = not sched.is_empty
        if self._in_flight and (not started or len(self._in_flight) >=
                                self.executor.max_in_flight):
            sched = self._in_flight.popleft()
            outcome = (self._ready.pop(sched.step_id) if sched.step_id in self._ready
                       else self._try_collect())
            result = self._execute(sched, outcome)
            deltas += self.scheduler.update_from_output(sched, result)
            deltas += self._fail_groups(self.scheduler.take_failed())
            applied = not sched.is_empty
        return started or applied, self._forget_finished(deltas)

    def _try_collect(self) -> ModelRunnerOutput | Exception:
        try:
            return self.executor.collect()
        except EngineFault:
            raise
        except Exception as exc:  # noqa: BLE001 - isolated by _execute
            return exc

    def _drain(self) -> None:
        """Collect every submitted step's outcome now (kept for its turn)."""
        for sched in self._in_flight:
            if sched.step_id not in self._ready:
                self._ready[sched.step_id] = self._try_collect()

    def _execute(self, sched: SchedulerOutput,
                 outcome: ModelRunnerOutput | Exception | None = None) -> ModelRunnerOutput:
        """Run the step (or take the ``outcome`` of its submitted run); on failure, bisect to
        the requests that cause it and fail those."""
        everyone = list(range(len(sched.req_ids)))

        def run(part):  # the first run applies the step's state changes, re-runs do not
            if part is everyone:
                if outcome is None:
                    return self.executor.execute_model(sched)
                if isinstance(outcome, Exception):
                    raise outcome
                return outcome
            self._drain()  # re-runs go through an empty pipe
            return self.executor.execute_model(sched.only(part))

        if not everyone:
            return run(everyone)
        results, failures = run_isolating(run, everyone)
        self._failed_steps = 0 if results else self._failed_steps + 1
        if not failures:
            return results[0]
        culprits = {self.scheduler.requests[sched.req_ids[i]].parent_id for i, _ in failures}
        if not results and (len(culprits) > 1 or self._failed_steps >= MAX_FAILED_STEPS):
            raise EngineFault(f"every request of {self._failed_steps} step(s) failed: "
                              f"{describe(failures[0][1])}") from failures[0][1]
        for i, exc in failures:
            self.scheduler.fail(self.scheduler.requests[sched.req_ids[i]], exc)
        return ModelRunnerOutput.merge(results)

    def _fail_groups(self, failed: list[tuple[Request, Exception]]) -> list[SequenceDelta]:
        """Finish the groups of failed sequences with "error" (their unfinished siblings too);
        the final delta of each sequence finished here."""
        deltas = []
        for request, exc in failed:
            children = self.sequences.get(request.parent_id)
            if children is None:
                continue  # its group failed already (or was aborted)
            reason = describe(exc)
            for child in children:
                if not child.is_finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ERROR)
                if not child.final_delta_sent:
                    deltas.append(sequence_delta(child, [], error=reason))
            del self.sequences[request.parent_id]
        return deltas

    def _forget_finished(self, deltas: list[SequenceDelta]) -> list[SequenceDelta]:
        for delta in deltas:
            children = self.sequences.get(delta.request_id)
            if delta.finished and children is not None and all(c.is_finished for c in children):
                del self.sequences[delta.request_id]
        return deltas

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's stats (``heron.engine.stats``)."""
        return snapshot(self.live_stats())

    def live_stats(self) -> EngineStats:
        """The engine's stats sharing the parts that go on changing: encode them at once."""
        cache, sched = self.kv_cache.prefix_cache, self.scheduler
        unfinished = self.num_unfinished_requests
        return EngineStats(
            timestamp=time.monotonic(), num_running=len(sched.running),
            num_waiting=len(sched.waiting), num_unfinished_requests=unfinished,
            kv_cache_usage=float(self.kv_cache.usage),
            num_free_blocks=self.kv_cache.num_free_blocks, num_blocks=self.kv_cache.num_blocks,
            num_cached_blocks=self.kv_cache.num_cached_blocks,
            num_prompt_tokens_total=self._prompt_tokens,
            num_generation_tokens_total=self._generated,
            num_requests_finished_total=self._accepted - unfinished,
            num_requests_rejected_total=self._rejected, scheduler=sched.stats,
            prefix_cache=cache.stats if cache is not None else PrefixCacheStats(),
            prefix_cache_enabled=cache is not None,
            spec_decode=sched.spec_stats if self.config.speculative else None,
            step_time=self._step_time, ranks=self.executor.rank_stats())
