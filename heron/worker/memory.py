"""Size the KV pool from the memory that is really left after the weights are loaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.config import CacheConfig
from heron.models import ModelArchConfig

# On CPU the pool is zero-filled up front, so keep the default modest; --kv-cache-memory or
# --gpu-memory-utilization lifts it.
CPU_DEFAULT_MAX_GB = 4.0
DEFAULT_MEMORY_FRACTION = 0.5


@dataclass(frozen=True)
class KVLayout:
    """What one rank's KV cache holds per token: its layers (a pipeline stage's), its KV
    heads (a tensor-parallel rank's), the head dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, arch: ModelArchConfig) -> KVLayout:
        """The whole model's (one rank)."""
        return cls(arch.num_layers, arch.num_kv_heads, arch.head_dim)


def bytes_per_block(layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
    """K and V for ``block_size`` tokens across the rank's layers."""
    elem = torch.finfo(dtype).bits // 8
    return 2 * layout.num_layers * block_size * layout.num_kv_heads * layout.head_dim * elem


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] * 1024


def num_kv_blocks(layout: KVLayout, cache: CacheConfig, dtype: torch.dtype,
                  device: torch.device, max_useful_tokens: int,
                  draft: KVLayout | None = None) -> int:
    """Blocks that fit in ``memory_fraction`` of available memory, under the caps (a fraction
    given explicitly lifts the CPU default cap, as vLLM's VLLM_CPU_KVCACHE_SPACE would).

    ``max_useful_tokens`` (max_num_seqs x max_model_len) bounds the pool: more is never used.
    A draft model's own cache (``draft``) has a block for every pool block.
    """
    if cache.num_blocks is not None:
        return cache.num_blocks
    fraction = cache.memory_fraction
    budget = available_bytes(device) * (fraction or DEFAULT_MEMORY_FRACTION)
    cap_gb = cache.max_memory_gb
    if cap_gb is None and fraction is None and device.type == "cpu":
        cap_gb = CPU_DEFAULT_MAX_GB
    if cap_gb is not None:
        budget = min(budget, cap_gb * 1024**3)
    per_block = bytes_per_block(layout, cache.block_size, dtype)
    if draft is not None:
        per_block += bytes_per_block(draft, cache.block_size, dtype)
    useful = -(-max_useful_tokens // cache.block_size)
    blocks = min(int(budget // per_block), useful)
    if blocks < 1:
        raise RuntimeError(f"not enough memory for a single KV block ({per_block} bytes); "
                           f"lower --max-model-len or raise --kv-cache-memory")
    return blocks
