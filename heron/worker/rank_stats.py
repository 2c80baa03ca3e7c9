"""What one worker rank reports about itself with every step it answers (multiprocess
executor): its totals since it started. Plain msgspec data that loads without torch, so the
API process can decode it inside ``heron.engine.stats.EngineStats``."""

from __future__ import annotations

import msgspec


class RankStats(msgspec.Struct):
    """One rank's totals since it started: steps run, time inside them, and of that time the
    part spent in collectives (all-reduce, gather, broadcast) and in pipeline send / recv
    (waiting for peers included), with the bytes this rank contributed to each; with context
    parallelism, the KV tokens it stored in its share of the pool (per KV cache group) and
    the prompt tokens it ran the model on in steps whose prefill was split across the CP
    ranks (``heron.attention.context_parallel_ring``)."""

    rank: int
    steps: int = 0
    busy_s: float = 0.0
    collective_s: float = 0.0
    collective_bytes: int = 0
    collective_calls: int = 0
    p2p_s: float = 0.0
    p2p_bytes: int = 0
    kv_tokens_stored: int = 0
    split_prefill_tokens: int = 0

    @property
    def compute_s(self) -> float:
        """Busy time outside communication."""
        return self.busy_s - self.collective_s - self.p2p_s
