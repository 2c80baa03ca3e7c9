"""A worker: one rank. Joins the tensor/context/pipeline-parallel groups, loads its shard of the
model on its device, sizes the KV cache from the memory left (every rank agrees on the
smallest pool; with context parallelism of N each rank stores 1/N of the pool the core sees),
and runs step messages. It knows nothing of requests beyond what
``step.SchedulerOutput`` tells it."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from heron import envs
from heron.config import EngineConfig, default_cpu_threads
from heron.logging_config import startup_phase
from heron.loader.model_source import ModelSource, resolve_model
from heron.loader.weights import (build_model, materialize_weights, model_weight_bytes,
                                  optimize_layout)
from heron.quant.base import use_int8_activations
from heron.quant.config import resolve_quantization
from heron.models import ModelArchConfig
from heron.distributed import get_cp_group, get_pp_group, get_tp_group, init_parallel
from heron.layers import cpu_gemm
from heron.layers.dispatch import apply_custom_ops
from heron.speculative.factory import load_draft
from heron.worker import cpu_binding
from heron.models.kv_cache_spec import kv_cache_groups
from heron.worker.memory import KVLayout, num_kv_blocks
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
                         f"tokens; lower it or give the cache more memory (a sliding-window "
                         f"or StreamingLLM request also holds one step's chunk: a smaller "
                         f"--max-num-batched-tokens needs fewer blocks)")
    logger.warning("max_model_len lowered from %d to the KV capacity %d", wanted, capacity)
    return capacity


def _use_int8_dot(model, device: torch.device) -> None:
    """--cpu-int8-dot: the model's quantized layers multiply through 8-bit activations."""
    if device.type != "cpu":
        logger.warning("--cpu-int8-dot applies on CPU only; ignored on %s", device)
        return
    switched = use_int8_activations(model)
    if switched:
        logger.info("--cpu-int8-dot: %d quantized layers multiply through 8-bit activations "
                    "(integer dot products; not exact against the dequantized path)", switched)
    else:
        logger.warning("--cpu-int8-dot: no layer of this model takes 8-bit activations (it "
                       "needs integer weights with groups of a multiple of 32 features)")


class Worker:
    """One rank: a model shard on one device. ``init_method`` (a torch.distributed URL) is
    needed when the world has more than one rank; ``source`` is the model as the engine core
    in this process resolved it (None: the worker resolves it)."""

    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None,
                 source: ModelSource | None = None) -> None:
        started = time.monotonic()
        par = config.parallel
        self.rank = rank
        self.device = _device(rank % par.ranks_per_node)
        _set_threads(config, self.device, rank)
        if par.world_size > 1:
            init_parallel(rank, par.tensor_parallel_size, par.pipeline_parallel_size,
                          init_method, "nccl" if self.device.type == "cuda" else "gloo",
                          par.collective_timeout_s, par.context_parallel_size)
        if self.device.type == "cpu":
            _build_cpu_kernels()
            _bind_threads(rank % par.ranks_per_node, par.ranks_per_node)
            _use_caching_allocator()
            if envs.HERON_BATCH_INVARIANT:
                cpu_gemm.set_batch_invariant(True)
                logger.info("batch invariant: float32 projections use one GEMM form for "
                            "every row count (HERON_BATCH_INVARIANT)")
        model, arch, dtype = self._load_model(config, source)
        spec = config.speculative
        draft = load_draft(spec, model, arch, dtype, self.device) if spec else None
        layers = model.kv_cache_layout()[0]
        sched = config.scheduler
        blocks = self._size_kv_cache(config, model, arch, dtype, draft)
        graphs = self.device.type == "cuda" and not config.enforce_eager
        with startup_phase(logger, "KV cache allocation" + (" and decode graphs" if graphs
                                                            else "")):
            self.runner = ModelRunner(model, blocks, config.cache.block_size, dtype,
                                      self.device, config.attention_backend, config.seed,
                                      enforce_eager=config.enforce_eager or par.world_size > 1,
                                      max_num_seqs=sched.max_num_seqs,
                                      max_model_len=self.max_model_len,
                                      speculative=spec, draft=draft)
        self.num_kv_blocks = blocks
        logger.info("heron worker %d/%d ready (tp rank %d, cp rank %d, pp stage %d, layers "
                    "%d-%d): %d KV blocks x %d tokens on %s in %.1fs", rank, par.world_size,
                    get_tp_group().rank_in_group, get_cp_group().rank_in_group,
                    get_pp_group().rank_in_group, layers[0], layers[-1],
                    blocks // par.context_parallel_size, config.cache.block_size,
                    self.device, time.monotonic() - started)

    def _size_kv_cache(self, config: EngineConfig, model, arch, dtype, draft) -> int:
        """The core's pool in KV blocks: from the memory left (the smallest over the ranks),
        times the context-parallel size N (each CP rank stores 1/N of it; --num-kv-blocks
        counts the core's pool, rounded up to a multiple of N); sets ``max_model_len`` to what
        they hold."""
        layers, kv_heads, head_dim = model.kv_cache_layout()
        wanted = config.max_model_len or arch.max_position_embeddings
        groups, block_size = kv_cache_groups(arch), config.cache.block_size
        chunk = config.scheduler.max_num_batched_tokens
        # a pool block holds one layer of a group's slot: the slots this stage's layers use
        slot_of = groups.slot_of_layer(arch.num_layers)
        per_block = KVLayout(len({slot_of[i] for i in layers}), kv_heads, head_dim)
        streaming = config.cache.streaming_kv
        useful = config.scheduler.max_num_seqs * groups.blocks_for(wanted, block_size, chunk,
                                                                   streaming)
        cp = config.parallel.context_parallel_size
        with startup_phase(logger, "KV cache sizing") as phase:
            local = _agree_min(num_kv_blocks(per_block, config.cache, dtype, self.device,
                                             -(-useful // cp) * block_size,
                                             _draft_kv_layout(draft)),
                               self.device)
            if config.cache.num_blocks is not None:
                local = -(-config.cache.num_blocks // cp)
            blocks = local * cp
            capacity = groups.max_tokens_in(blocks, block_size, chunk, wanted, streaming)
            self.max_model_len = fit_max_model_len(wanted, config.max_model_len, capacity)
            phase.detail = f"{blocks} blocks x {block_size} tokens"
            if cp > 1:
                phase.detail += f" ({local} on each of {cp} context-parallel ranks)"
            if len(groups) > 1 or groups[0].is_sliding:
                phase.detail += f", {_describe(groups)}"
        return blocks

    def _load_model(self, config: EngineConfig, source: ModelSource | None):
        """Build this rank's shard of the checkpoint (resolved here unless ``source`` is
        given) and fill it: (model, arch, dtype)."""
        with startup_phase(logger, "weights") as phase:
            if source is None:
                source = resolve_model(config.model, config.load_format, config.hf_overrides)
            arch = ModelArchConfig.from_hf(source.hf_config)
            dtype = config.torch_dtype
            quant = resolve_quantization(source.quantization, source.is_gguf,
                                         config.quantization, self.device.type)
            model = build_model(arch, dtype, self.device, quant)
            materialize_weights(model, source, config.load_format, dtype, config.seed, quant)
            optimize_layout(model, self.device)
            self.custom_ops = apply_custom_ops(model, config.custom_ops, self.device, dtype)
            if config.cpu_int8_dot:
                _use_int8_dot(model, self.device)
            self.bytes_read = source.read_counter.bytes_read
            self.quantization = quant.describe() if quant else "none"
            self.weight_bytes = model_weight_bytes(model)
            phase.detail = (f"rank {self.rank}: {self.quantization}, "
                            f"{self.weight_bytes / 1e6:.1f} MB")
        return model, arch, dtype

    @property
    def is_driver(self) -> bool:
        """The rank whose step results the core reads: TP and CP rank 0 of the last stage."""
        return get_tp_group().is_first and get_cp_group().is_first and get_pp_group().is_last

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.num_kv_blocks, self.max_model_len, self.runner.backend.name,
                          str(self.device), self.rank, self.bytes_read, self.quantization,
                          self.weight_bytes)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's outcome on the driver rank; None on the others."""
        return self.runner.execute(sched)


def _describe(groups) -> str:
    """e.g. "KV cache groups: 1 full x 3 layers, 5 sliding (window 512) x 3 layers"."""
    kinds: dict[str, int] = {}
    for group in groups:
        kind = "full" if not group.is_sliding else f"sliding (window {group.sliding_window})"
        kinds[kind] = kinds.get(kind, 0) + 1
    return "KV cache groups: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + \
        f" x {groups.group_size} layers"


def _draft_kv_layout(draft) -> KVLayout | None:
    """What the draft's own cache holds per token (None: none, or it shares the target's)."""
    layout = draft.kv_layout() if draft is not None else None
    return KVLayout(*layout) if layout is not None else None


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _build_cpu_kernels() -> None:
    """heron's C++ CPU kernels, compiled on first use on a machine (a minute or two), then
    loaded from the cache: a phase of its own, so a first start does not look hung."""
    from heron.kernels import cpu

    with startup_phase(logger, "CPU kernels") as phase:
        phase.detail = "built and loaded" if cpu.load() else "unavailable: torch reference path"


def _set_threads(config: EngineConfig, device: torch.device, rank: int) -> None:
    """``--threads``, or on CPU heron's default (``default_cpu_threads``); logged once."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
        why = f"{config.num_threads} (--threads)"
    elif device.type == "cpu":
        threads, why = default_cpu_threads(config.parallel.ranks_per_node)
        torch.set_num_threads(threads)
    else:
        return
    if rank == 0:
        logger.info("torch threads: %s", why)


def _bind_threads(local_rank: int, ranks_per_node: int) -> None:
    """Pins this rank's torch threads as ``HERON_CPU_OMP_THREADS_BIND`` says (default: no)."""
    cpus = cpu_binding.cpus_for_rank(envs.HERON_CPU_OMP_THREADS_BIND, torch.get_num_threads(),
                                     local_rank, ranks_per_node)
    if cpus is None:
        return
    if not hasattr(torch.ops.heron_cpu, "bind_threads"):
        raise RuntimeError("HERON_CPU_OMP_THREADS_BIND needs heron's C++ CPU kernels, "
                           "which did not build here")
    torch.ops.heron_cpu.bind_threads(cpus)
    logger.info("torch threads of rank %d pinned to cores %s (HERON_CPU_OMP_THREADS_BIND)",
                local_rank, cpus)


def _use_caching_allocator() -> None:
    """CPU tensors of 1 MiB and more from heron's caching allocator, which keeps up to
    ``HERON_CPU_ALLOCATOR_CACHE_MB`` of freed blocks (vLLM's CPU workers preload tcmalloc for
    the same reason): a prefill's intermediates stop costing a page fault per 4 KiB."""
    limit = envs.HERON_CPU_ALLOCATOR_CACHE_MB
    if limit and hasattr(torch.ops.heron_cpu, "use_caching_allocator"):
        torch.ops.heron_cpu.use_caching_allocator(limit)


def _agree_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over every rank (they share one block table)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64,
                     device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
