"""The offline engine: tokenize -> ``EngineCore`` (sequence deltas) -> ``OutputProcessor``
(text, stop strings, n > 1) -> ``RequestOutput``s, all in this process."""

from __future__ import annotations

import itertools
import logging

from heron.config import EngineConfig
from heron.engine.core import EngineCore
from heron.engine.core_outputs import RequestOutputKind
from heron.engine.output_processor import OutputProcessor
from heron.engine.stats import EngineStats
from heron.tokenizer import load_tokenizer
from heron.logging_config import startup_phase
from heron.outputs import RequestOutput
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Add requests, ``step()``, collect outputs; a stop string found after a step finishes
    its sequence in the core before the next step (so nothing is generated past it)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        logger.debug("starting heron engine: %s", config.model or "embedded SmolLM2-135M-Instruct")
        self.core = EngineCore(config)
        with startup_phase(logger, "tokenizer"):
            self.tokenizer = load_tokenizer(self.core.tokenizer_dir)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    # the core's facts, for callers that inspect the engine
    arch = property(lambda self: self.core.arch)
    model_name = property(lambda self: self.core.model_name)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    max_model_len = property(lambda self: self.core.max_model_len)
    tokenizer_dir = property(lambda self: self.core.tokenizer_dir)
    kv_cache = property(lambda self: self.core.kv_cache)
    scheduler = property(lambda self: self.core.scheduler)

    @property
    def runner(self):
        """The in-process worker's model runner (introspection and tests; ``uni`` only)."""
        worker = getattr(self.core.executor, "worker", None)
        if worker is None:
            raise AttributeError("the model runner lives in a worker process (executor 'mp')")
        return worker.runner

    def shutdown(self) -> None:
        self.core.shutdown()

    # ---- requests ------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead")
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """Validate and queue; raises ValueError (queueing nothing) for bad input. ``step``
        then returns this request's outputs as ``output_kind`` says."""
        token_ids = self.tokenize(prompt)
        self.core.add_request(request_id, token_ids, params, arrival_time, cache_salt)
        self.output_processor.add_request(request_id, prompt if isinstance(prompt, str) else None,
                                          token_ids, params, output_kind)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        deltas = self.core.abort_request(request_id)
        if not self.output_processor.has(request_id):
            return None
        outputs = self.output_processor.process(deltas).outputs
        self.output_processor.abort(request_id)
        return outputs[0] if outputs else None

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def take_kv_events(self) -> list:
        return self.core.take_kv_events()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; outputs of the requests that progressed, finished or failed.
        Raises ``EngineFault`` when no request explains a failure."""
        processed = self.output_processor.process(self.core.step())
        for request_id, index, stop in processed.stops:
            self.core.finish_sequence(request_id, index, stop)
        for request_id in processed.failed:
            self.core.abort_request(request_id)
        return processed.outputs

    def stats(self) -> EngineStats:
        """A snapshot of the engine's stats (``heron.engine.stats``)."""
        return self.core.stats()
