"""A worker: loads the model on its device, sizes the KV cache from the memory left, and runs
step messages. It knows nothing of requests beyond what ``step.SchedulerOutput`` tells it."""

from __future__ import annotations

import logging
import time

import torch

from heron.config import EngineConfig
from heron.loader.model_source import resolve_model
from heron.loader.weights import build_model, materialize_weights, optimize_layout
from heron.models import ModelArchConfig
from heron.worker.memory import num_kv_blocks
from heron.worker.model_runner import ModelRunner
from heron.worker.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo

logger = logging.getLogger(__name__)


def fit_max_model_len(wanted: int, configured: int | None, capacity: int) -> int:
    """The context the KV pool can hold: ``wanted``, or ``capacity`` when the model's default
    is larger (a configured length that does not fit is an error)."""
    if wanted <= capacity:
        return wanted
    if configured is not None:
        raise ValueError(f"max_model_len {wanted} exceeds the KV cache capacity of {capacity} "
                         f"tokens; lower it or give the cache more memory")
    logger.warning("max_model_len lowered from %d to the KV capacity %d", wanted, capacity)
    return capacity


class Worker:
    """One model replica on one device (rank 0 of 1 today)."""

    def __init__(self, config: EngineConfig) -> None:
        started = time.monotonic()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        source = resolve_model(config.model, config.load_format)
        arch = ModelArchConfig.from_hf(source.hf_config)
        dtype = config.torch_dtype
        model = build_model(arch, dtype, self.device)
        materialize_weights(model, source, config.load_format, dtype, config.seed)
        optimize_layout(model, self.device)
        wanted = config.max_model_len or arch.max_position_embeddings
        sched = config.scheduler
        blocks = num_kv_blocks(arch, config.cache, dtype, self.device,
                               sched.max_num_seqs * wanted)
        self.max_model_len = fit_max_model_len(wanted, config.max_model_len,
                                               blocks * config.cache.block_size)
        self.runner = ModelRunner(model, blocks, config.cache.block_size, dtype, self.device,
                                  config.attention_backend, config.seed,
                                  enforce_eager=config.enforce_eager,
                                  max_num_seqs=sched.max_num_seqs,
                                  max_model_len=self.max_model_len)
        self.num_kv_blocks = blocks
        logger.info("heron worker ready: %d KV blocks x %d tokens on %s in %.1fs", blocks,
                    config.cache.block_size, self.device, time.monotonic() - started)

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.num_kv_blocks, self.max_model_len, self.runner.backend.name,
                          str(self.device))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)
