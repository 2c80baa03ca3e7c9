"""Frozen configuration dataclasses. Every knob of the engine lives here, validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name onto a torch dtype, or raise a clear ValueError."""
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ValueError(f"unsupported dtype {name}; choose one of float32, bfloat16, float16")
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16") from None


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    The pool is sized from memory that is really available after the weights are loaded
    (``memory_fraction`` of it), capped by ``max_memory_gb`` and, if given, ``num_blocks``.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_memory_gb: float | None = None
    memory_fraction: float = 0.5
    enable_prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (radix tree)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


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
    # "uni": the worker runs in the engine core's process; "mp": in a process of its own
    distributed_executor_backend: str = "uni"

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.distributed_executor_backend not in ("uni", "mp"):
            raise ValueError(f"distributed_executor_backend must be 'uni' or 'mp', got "
                             f"{self.distributed_executor_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


# ---- environment ------------------------------------------------------------------------------
def fault_injection_token() -> int | None:
    """``HERON_FAULT_INJECTION_TOKEN`` (for reliability tests): a request whose prompt holds
    this token id raises while the engine processes its output, as a bug would, so tests can
    show that one failing request costs only that request."""
    value = os.environ.get("HERON_FAULT_INJECTION_TOKEN")
    return int(value) if value else None
