"""The synchronous engine: add requests, step (schedule -> run -> postprocess), collect outputs."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from heron.config import EngineConfig, fault_injection_token
from heron.engine.detokenizer import IncrementalDetokenizer
from heron.engine.kv_cache import KVCacheManager
from heron.engine.output_processor import RequestGroup
from heron.engine.request import Request, RequestStatus
from heron.engine.isolation import EngineFault, describe, run_isolating
from heron.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from heron.loader.model_source import load_tokenizer, resolve_model
from heron.loader.weights import build_model, materialize_weights, optimize_layout
from heron.models import ModelArchConfig, get_model_class
from heron.models.config import architecture_of
from heron.outputs import RequestOutput
from heron.worker.memory import num_kv_blocks
from heron.worker.model_runner import ModelRunner, StepResult
from heron.sampling_params import SamplingParams, child_seed

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


class LLMEngine:
    """Owns the scheduler, the KV cache and the model runner of one model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        started = time.monotonic()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        source = resolve_model(config.model, config.load_format)
        get_model_class(architecture_of(source.hf_config))  # unsupported: fail before parsing
        self.arch = ModelArchConfig.from_hf(source.hf_config)
        self.model_name = source.name
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = config.torch_dtype
        model = build_model(self.arch, dtype, self.device)
        materialize_weights(model, source, config.load_format, dtype, config.seed)
        optimize_layout(model, self.device)
        self.tokenizer_dir = source.tokenizer_dir  # where another process can load it from
        self.tokenizer = load_tokenizer(source.tokenizer_dir)
        self.eos_token_ids = _eos_ids(source, self.arch)
        self.max_model_len = config.max_model_len or self.arch.max_position_embeddings
        block_size = config.cache.block_size
        blocks = num_kv_blocks(self.arch, config.cache, dtype, self.device,
                               config.scheduler.max_num_seqs * self.max_model_len)
        self._fit_max_model_len(blocks * block_size)
        self.kv_cache = KVCacheManager(blocks, block_size, config.cache.enable_prefix_caching,
                                       record_events=config.kv_events_endpoint is not None)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.runner = ModelRunner(model, blocks, block_size, dtype, self.device,
                                  config.attention_backend, config.seed,
                                  enforce_eager=config.enforce_eager,
                                  max_num_seqs=config.scheduler.max_num_seqs,
                                  max_model_len=self.max_model_len)
        self.groups: dict[str, RequestGroup] = {}
        self._ids = itertools.count()
        self._failed_steps = 0  # consecutive steps in which every request failed
        self._fault_token = fault_injection_token()
        logger.info("heron engine ready: %s (%s, %s) with %d KV blocks x %d tokens in %.1fs",
                    self.model_name, self.arch.architecture, config.dtype, blocks, block_size,
                    time.monotonic() - started)

    def _fit_max_model_len(self, capacity: int) -> None:
        if self.max_model_len <= capacity:
            return
        if self.config.max_model_len is not None:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the KV cache capacity "
                             f"of {capacity} tokens; lower it or give the cache more memory")
        logger.warning("max_model_len lowered from %d to the KV capacity %d",
                       self.max_model_len, capacity)
        self.max_model_len = capacity

    # ---- requests ------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead")
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}: no room to generate")
        bad = [t for t in token_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"token ids out of the vocabulary [0, {self.arch.vocab_size}): "
                             f"{bad[:5]}")

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this vocabulary."""
        bad = [t for t in params.stop_token_ids if t >= self.arch.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids out of the vocabulary [0, "
                             f"{self.arch.vocab_size}): {bad[:5]}")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Validate and queue; raises ValueError (queueing nothing) for bad input.

        ``arrival_time`` (time.monotonic) defaults to now; a server passes its own receipt time.
        Requests share cached prefixes only with requests of the same ``cache_salt``.
        """
        if request_id in self.groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        self.validate_params(params)
        room = self.max_model_len - len(token_ids)
        max_tokens = min(params.max_tokens or room, room)
        children = [self._child(request_id, i, token_ids, params, max_tokens)
                    for i in range(params.n)]
        for child in children:
            child.cache_salt = cache_salt
            if arrival_time is not None:
                child.arrival_time = arrival_time
        detoks = [self._detokenizer(token_ids, params) for _ in children]
        self.groups[request_id] = RequestGroup(
            request_id, prompt if isinstance(prompt, str) else None, children, detoks)
        for child in children:
            self.scheduler.add(child)

    def _child(self, request_id, index, token_ids, params, max_tokens) -> Request:
        child = Request(request_id if params.n == 1 else f"{request_id}#{index}", list(token_ids),
                        params, eos_token_ids=self.eos_token_ids, max_tokens=max_tokens,
                        parent_id=request_id, index=index)
        if params.seed is not None and index > 0:
            child.generator = torch.Generator().manual_seed(child_seed(params.seed, index))
        return child

    def _detokenizer(self, token_ids, params) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, params.stop,
                                      params.include_stop_str_in_output,
                                      params.skip_special_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for child in group.children:
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
        return group.to_output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

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
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns outputs of requests that made progress or failed.

        A request whose processing raises (scheduling, sampling, detokenizing) is finished
        with finish_reason "error" and the others go on; ``EngineFault`` when no request
        explains the failure.
        """
        sched = self.scheduler.schedule()
        failed = self._fail_groups(sched.failed)
        if sched.is_empty:
            return self._emit(failed)
        result = self._execute(sched)
        self.scheduler.update_after_step(sched)
        failed.update(self._fail_groups(sched.failed))
        return self._emit({**failed, **self._postprocess(sched, result)})

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        """Run the step; on failure, bisect to the requests that cause it and fail those."""
        def run(part):
            return self.runner.execute(SchedulerOutput(scheduled=list(part)))

        results, failures = run_isolating(run, sched.scheduled)
        self._failed_steps = 0 if results else self._failed_steps + 1
        if not failures:
            return results[0]
        culprits = {scheduled.request.parent_id for scheduled, _ in failures}
        if not results and (len(culprits) > 1 or self._failed_steps >= MAX_FAILED_STEPS):
            raise EngineFault(f"every request of {self._failed_steps} step(s) failed: "
                              f"{describe(failures[0][1])}") from failures[0][1]
        for scheduled, exc in failures:
            self.scheduler.fail(scheduled.request, exc, sched)
        sched.scheduled = [s for s in sched.scheduled if not s.request.is_finished]
        merged = StepResult()
        for part in results:
            merged.sampled.update(part.sampled)
            merged.logprobs.update(part.logprobs)
            merged.prompt_logprobs.update(part.prompt_logprobs)
        return merged

    def _fail_groups(self, failed: list[tuple[Request, Exception]]) -> dict[str, RequestGroup]:
        """Finish the groups of failed sequences with an error (their siblings too); returns
        the groups failed now (a group that already failed is not returned again)."""
        groups: dict[str, RequestGroup] = {}
        for request, exc in failed:
            group = self.groups.get(request.parent_id)
            if group is None or group.error is not None:
                continue
            group.error = describe(exc)
            for child in group.children:
                if not child.is_finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ERROR)
            groups[group.request_id] = group
        return groups

    def _emit(self, groups: dict[str, RequestGroup]) -> list[RequestOutput]:
        """Outputs of the groups that progressed; finished groups are forgotten."""
        outputs = [g.to_output() for g in groups.values()]
        for out in outputs:
            if out.finished:
                del self.groups[out.request_id]
        return outputs

    def _postprocess(self, sched: SchedulerOutput, result: StepResult
                     ) -> dict[str, RequestGroup]:
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for s in sched.scheduled:
            req = s.request
            group = self.groups[req.parent_id]
            if group.error is not None:
                touched[group.request_id] = group
                continue
            try:
                progressed = self._apply_step(s, group, result, now)
            except Exception as exc:  # noqa: BLE001 - detokenizer, stop checks, logprobs
                self.scheduler.fail(req, exc)
                self._fail_groups([(req, exc)])
                progressed = True
            if progressed:
                touched[group.request_id] = group
        return touched

    def _apply_step(self, s: ScheduledRequest, group: RequestGroup, result: StepResult,
                    now: float) -> bool:
        """Record one request's prompt logprobs and sampled token; True if it sampled."""
        req = s.request
        if req.request_id in result.prompt_logprobs:
            lps = result.prompt_logprobs[req.request_id]
            first = req.num_computed_tokens - s.num_tokens + 1
            req.prompt_logprobs[first:first + len(lps)] = lps
        token = result.sampled.get(req.request_id)
        if token is None:
            return False  # mid-prefill chunk
        if self._fault_token is not None and self._fault_token in req.prompt_token_ids:
            raise RuntimeError(f"injected fault (prompt holds token {self._fault_token})")
        self._append_token(req, token, result, now)
        stop = group.update_text(req.index)
        if stop is not None and not req.is_finished:
            req.stop_reason = stop
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        return True

    def _append_token(self, req: Request, token: int, result: StepResult, now: float) -> None:
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        if req.request_id in result.logprobs:
            req.logprobs.append(result.logprobs[req.request_id])
        status = self._token_stop(req, token)
        if status is not None:
            self.scheduler.finish(req, status)

    def _token_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.params
        if req.num_output_tokens >= params.min_tokens:
            if token in req.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        cache = self.kv_cache.prefix_cache
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.kv_cache.usage,
            "num_free_blocks": self.kv_cache.num_free_blocks,
            "num_blocks": self.kv_cache.num_blocks,
            "num_preemptions": self.scheduler.stats.num_preemptions,
            "num_prefill_tokens": self.scheduler.stats.num_prefill_tokens,
            "prefix_cache_enabled": cache is not None,
            "prefix_cache_queries": cache.stats.queries if cache else 0,
            "prefix_cache_hits": cache.stats.hits if cache else 0,
            "num_cached_blocks": len(cache) if cache else 0,
        }
