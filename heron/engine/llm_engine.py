"""The synchronous engine: add requests, step (schedule -> run -> postprocess), collect outputs."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from heron.config import EngineConfig
from heron.engine.detokenizer import IncrementalDetokenizer
from heron.engine.kv_cache import KVCacheManager
from heron.engine.output_processor import RequestGroup
from heron.engine.request import Request, RequestStatus
from heron.engine.scheduler import Scheduler, SchedulerOutput
from heron.loader.model_source import load_tokenizer, resolve_model
from heron.loader.weights import build_model, materialize_weights, optimize_layout
from heron.models import ModelArchConfig, get_model_class
from heron.models.config import architecture_of
from heron.outputs import RequestOutput
from heron.runner.memory import num_kv_blocks
from heron.runner.model_runner import ModelRunner, StepResult
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
            child.generator = torch.Generator().manual_seed(params.seed + index)
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
        """One engine iteration; returns outputs of requests that made progress."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.runner.execute(sched)
        self.scheduler.update_after_step(sched)
        return self._postprocess(sched, result)

    def _postprocess(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for s in sched.scheduled:
            req = s.request
            group = self.groups[req.parent_id]
            if req.request_id in result.prompt_logprobs:
                lps = result.prompt_logprobs[req.request_id]
                first = req.num_computed_tokens - s.num_tokens + 1
                req.prompt_logprobs[first:first + len(lps)] = lps
            token = result.sampled.get(req.request_id)
            if token is None:
                continue  # mid-prefill chunk
            self._append_token(req, token, result, now)
            stop = group.update_text(req.index)
            if stop is not None and not req.is_finished:
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            touched[group.request_id] = group
        outputs = [g.to_output() for g in touched.values()]
        for out in outputs:
            if out.finished:
                del self.groups[out.request_id]
        return outputs

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
