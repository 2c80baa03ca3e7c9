"""Frozen configuration dataclasses. Every knob of the engine lives here, validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from heron.sampling_params import streaming_kv_spec

if TYPE_CHECKING:
    import torch

# dtype names a user may give -> torch's name for it. The config keeps the name; torch is
# imported only where a dtype is resolved (``parse_dtype``), so the API process stays torch-free.
_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
_CHOICES = "choose one of float32, bfloat16, float16"


def canonical_dtype(name: str | torch.dtype) -> str:
    """torch's name (``float32``, ``bfloat16``, ``float16``) of a user-facing dtype name or
    of a torch dtype; a clear ValueError for anything else. Needs no torch."""
    if not isinstance(name, str):  # a torch.dtype: str() is "torch.float16"
        canonical = str(name).removeprefix("torch.")
        if canonical not in _DTYPE_NAMES.values():
            raise ValueError(f"unsupported dtype {name}; {_CHOICES}")
        return canonical
    try:
        return _DTYPE_NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; {_CHOICES}") from None


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name onto a torch dtype, or raise a clear ValueError."""
    import torch

    return getattr(torch, canonical_dtype(name))


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    The pool is sized from memory that is really available after the weights are loaded
    (``memory_fraction`` of it), capped by ``max_memory_gb`` and, if given, ``num_blocks``.
    ``memory_fraction`` None means 0.5 and, on CPU, a 4 GB cap unless ``max_memory_gb`` says
    otherwise; a fraction given (``--gpu-memory-utilization``) is the budget, uncapped.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_memory_gb: float | None = None
    memory_fraction: float | None = None
    enable_prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (radix tree)
    # --streaming-kv: StreamingLLM's (sink_tokens, window) for requests that do not set their
    # own (heron.sampling_params.streaming_kv_spec); None: whole contexts
    streaming_kv: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "streaming_kv", streaming_kv_spec(self.streaming_kv))
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_utilization (the KV cache's share of the free "
                             f"memory) must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of continuous batching.

    Each step schedules at most ``max_num_batched_tokens`` tokens over at most ``max_num_seqs``
    requests; a prompt longer than the budget is prefilled in chunks (chunked prefill).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # New prefills are admitted only while this fraction of KV blocks stays free after their
    # allocation, so running decodes keep room to grow (load shedding near a full cache).
    kv_watermark: float = 0.01
    # Admission order of waiting requests: "fcfs", or "lpm" (longest cached prefix first; a
    # request overtaken max_overtakes times goes first regardless).
    policy: str = "fcfs"
    max_overtakes: int = 32

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'lpm', got {self.policy!r}")
        if self.max_overtakes < 0:
            raise ValueError("max_overtakes must be >= 0")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError("kv_watermark must be in [0, 1)")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over worker ranks (vLLM's names).

    ``tensor_parallel_size`` ranks split every layer (heads, MLP features, vocabulary);
    ``context_parallel_size`` ranks split every request's KV cache by block (each attends over
    its blocks; the partial outputs merge exactly, ``heron.attention.context_parallel``);
    ``pipeline_parallel_size`` stages split the layers. World size = tp x cp x pp (rank
    layout: ``heron.distributed.parallel_state``). Multi-node: each node runs ``nnodes``'s
    share of the ranks, ``node_rank`` 0 hosting the engine core, and the ranks meet at
    ``master_addr:master_port``.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on this host (single node)
    # a collective or a step that takes longer than this is a hung rank: an engine fault
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                     "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"world size {self.world_size} (tp x cp x pp) is not divisible by "
                             f"nnodes {self.nnodes}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("a multi-node world needs --master-port (and --master-addr)")
        if self.collective_timeout_s <= 0:
            raise ValueError("collective_timeout_s must be > 0")

    @property
    def world_size(self) -> int:
        return (self.tensor_parallel_size * self.context_parallel_size
                * self.pipeline_parallel_size)

    @property
    def driver_rank(self) -> int:
        """The rank whose step results the core reads: TP and CP rank 0 of the last stage
        (the layout of ``heron.distributed.parallel_state``)."""
        return ((self.pipeline_parallel_size - 1) * self.context_parallel_size
                * self.tensor_parallel_size)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


SPEC_METHODS = ("ngram", "draft", "eagle", "layer_skip")
_SPEC_ALIASES = {"draft_model": "draft", "[ngram]": "ngram"}


def parse_token_tree(spec: str | list) -> tuple[tuple[int, ...], ...]:
    """The nodes of a draft token tree, e.g. ``"[(0,), (1,), (0, 0)]"`` (or the list itself):
    each node is its path of choice ranks from the root; sorted by depth, then rank. A node's
    parent must be on the greedy chain (all ranks 0 but the last). ValueError if malformed."""
    import ast

    try:
        raw = ast.literal_eval(spec) if isinstance(spec, str) else spec
        paths = sorted({tuple(int(r) for r in p) for p in raw}, key=lambda p: (len(p), p))
    except (ValueError, SyntaxError, TypeError) as exc:
        raise ValueError(f"speculative_token_tree must be a list of tuples of ranks, "
                         f"e.g. [(0,), (1,), (0, 0)]: {exc}") from None
    if not paths:
        raise ValueError("speculative_token_tree has no nodes")
    known = set(paths)
    for path in paths:
        if not path or min(path) < 0:
            raise ValueError(f"tree node {path}: ranks must be >= 0, paths non-empty")
        if any(path[:-1]):
            raise ValueError(f"tree node {path}: a node's parent must be on the greedy "
                             f"chain (all ranks 0 but the last)")
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(f"tree node {path} has no parent {path[:-1]}")
    return tuple(paths)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, vLLM's keys).

    A proposer drafts up to ``num_speculative_tokens`` tokens per decoding sequence after
    each step; the next step verifies them with the target (greedy: exact match; sampling:
    rejection sampling, lossless). Methods: ``ngram`` (prompt lookup: the tokens that
    followed the latest earlier occurrence of the sequence's last ``prompt_lookup_max`` ..
    ``prompt_lookup_min`` tokens), ``draft`` (a smaller ``model`` sharing the tokenizer),
    ``eagle`` (a head trained by ``heron train-draft``, at ``model``), ``layer_skip`` (the
    target's first ``num_layers`` layers, no training). Speculation is skipped for steps
    that run ``disable_by_batch_size`` or more sequences (large batches are compute bound).
    ``speculative_token_tree`` (model drafts) verifies a static tree of candidates instead
    of one chain (``tree_paths``; ``heron.speculative.tree`` builds the tree from them);
    ``num_speculative_tokens`` is then its depth.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft model or EAGLE head directory
    num_layers: int | None = None  # layer_skip: target layers the draft runs (default: 1/4)
    disable_by_batch_size: int | None = None
    speculative_token_tree: str | None = None  # e.g. "[(0,), (1,), (0, 0), (0, 1)]"

    def __post_init__(self) -> None:
        method = _SPEC_ALIASES.get(self.method, self.method)
        object.__setattr__(self, "method", method)
        if method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of "
                             f"{', '.join(SPEC_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if method in ("draft", "eagle") and not self.model:
            raise ValueError(f"speculative method {method!r} needs \"model\" (a directory)")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if self.speculative_token_tree is not None:
            if method == "ngram":
                raise ValueError("speculative_token_tree needs a model draft (its ranked "
                                 "choices); prompt lookup drafts one chain")
            object.__setattr__(self, "num_speculative_tokens", len(self.tree_paths[-1]))

    @property
    def tree_paths(self) -> tuple[tuple[int, ...], ...] | None:
        """The nodes of ``speculative_token_tree`` (checked; by depth, then rank) or None."""
        if self.speculative_token_tree is None:
            return None
        return parse_token_tree(self.speculative_token_tree)

    @classmethod
    def from_dict(cls, spec: dict | str | None) -> SpeculativeConfig | None:
        """From ``--speculative-config``'s JSON (or its dict); None stays None."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            import json

            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown --speculative-config keys {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**spec)

    @property
    def writes_draft_kv(self) -> bool:
        """Model-based drafts write KV for the positions they draft (lookahead slots)."""
        return self.method != "ngram"


def parse_custom_ops(names: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``--custom-ops``' value ("a,b", or a list) as op names; a leading "+" (vLLM's "enable"
    spelling in ``compilation_config.custom_ops``) is accepted, "-name" is not (a built-in
    path needs no flag)."""
    if names is None:
        return ()
    items = names.split(",") if isinstance(names, str) else list(names)
    out = []
    for item in (i.strip() for i in items):
        if item.startswith("-") or item in ("all", "none"):
            raise ValueError(f"custom op {item!r}: name the plugin ops to select; heron's "
                             f"built-in paths run wherever no op is selected")
        if item.removeprefix("+"):
            out.append(item.removeprefix("+"))
    if len(set(out)) != len(out):
        raise ValueError(f"custom ops name an op twice: {','.join(out)}")
    return tuple(out)


def parse_hf_overrides(overrides: dict | str | None) -> dict | None:
    """``--hf-overrides`` (vLLM's flag): a JSON object (or its dict) merged into the model's
    config.json; None or {} stays None. ValueError, one line, for anything else."""
    if not overrides:
        return None
    if isinstance(overrides, str):
        import json

        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-overrides is not valid JSON ({exc}); e.g. --hf-overrides "
                             f"'{{\"rope_scaling\": {{\"rope_type\": \"yarn\", \"factor\": 4.0}}}}'"
                             ) from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--hf-overrides must be a JSON object (config.json keys), got "
                         f"{type(overrides).__name__}")
    return overrides or None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start: which model, how to run it, how to batch."""

    model: str | None = None  # HF directory, .gguf file, or None for the embedded SmolLM2
    dtype: str = "float32"
    max_model_len: int | None = None
    attention_backend: str = "auto"  # "auto": triton on CUDA (if installed), else torch
    seed: int = 0
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    num_threads: int | None = None
    load_format: str = "auto"  # "auto": weights from the model files; "dummy": random weights
    enforce_eager: bool = False  # True: never capture CUDA graphs
    kv_events_endpoint: str | None = None  # ZMQ PUB address for prefix-cache events (serve)
    # "uni": the worker runs in the engine core's process; "mp": each rank in a process of
    # its own. None: "uni" for one rank, "mp" for more (see executor_backend)
    distributed_executor_backend: str | None = None
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None
    # gptq | awq | compressed-tensors | gguf | fp8 | none; None: what the checkpoint holds
    # (a GGUF file stays quantized on CPU)
    quantization: str | None = None
    tokenizer: str | None = None  # a tokenizer directory other than the model's (--tokenizer)
    # plugin ops (heron.kernels.plugins) the worker selects for the model (--custom-ops)
    custom_ops: tuple[str, ...] = ()
    # CPU: quantized layers multiply through 8-bit activations and integer dot products, as
    # llama.cpp does (--cpu-int8-dot; faster at small batches, not exact). Default off.
    cpu_int8_dot: bool = False
    # merged into the model's config.json, nested objects recursively (--hf-overrides; plain
    # data: worker processes resolve the model with the same overrides)
    hf_overrides: dict | None = None

    def __post_init__(self) -> None:
        canonical_dtype(self.dtype)  # the name is checked now, resolved by the worker
        object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))
        object.__setattr__(self, "custom_ops", parse_custom_ops(self.custom_ops))
        if self.speculative is not None and self.parallel.world_size > 1:
            raise ValueError("speculative decoding runs on one rank for now (tensor x "
                             "context x pipeline parallel size 1)")
        if self.cache.streaming_kv is not None and self.parallel.context_parallel_size > 1:
            raise ValueError("--streaming-kv (StreamingLLM) is not supported with context "
                             "parallelism (--context-parallel-size > 1)")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.distributed_executor_backend not in (None, "uni", "mp"):
            raise ValueError(f"distributed_executor_backend must be 'uni' or 'mp', got "
                             f"{self.distributed_executor_backend!r}")
        if self.parallel.world_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(f"the 'uni' executor runs one rank; tensor x context x pipeline "
                             f"parallel size {self.parallel.world_size} needs 'mp'")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch dtype (imports torch: for the engine's side only)."""
        return parse_dtype(self.dtype)

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.parallel.world_size > 1 else "uni"


def default_cpu_threads(ranks_per_node: int, cores: int | None = None) -> tuple[int, str]:
    """Torch intra-op threads for one CPU rank when ``--threads`` is not given, and why.

    One core is left for the rest (the API server, the scheduler, the tokenizer, other
    work on the machine): with every core busy in an OpenMP parallel region, one descheduled
    thread stalls the whole region at its barrier, and a shared machine then runs seconds per
    token (measured: benchmarks/results/threads.md). The other cores are shared out between
    this node's ranks; at least one thread each."""
    cores = cores or len(os.sched_getaffinity(0))
    threads = max(1, (cores - 1) // ranks_per_node)
    per_rank = f" for each of {ranks_per_node} ranks" if ranks_per_node > 1 else ""
    if threads * ranks_per_node < cores:
        why = "one left for the API server and scheduler"
    else:
        why = "at least one per rank" if ranks_per_node > 1 else "the only core"
    return threads, f"{threads} of {cores} cores{per_rank} ({why}); --threads to change"

