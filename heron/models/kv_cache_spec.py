"""KV cache groups: which layers share a block table, and which pool tensor each layer uses.

A layer's cache spec says which keys its queries can still see: all of them (full attention)
or the last ``sliding_window`` positions. Layers with the same spec form groups of equal size
(vLLM's hybrid layout): every group has its own block table per request, and all groups draw
block ids from one shared pool whose blocks hold ``group_size`` layers each. Layer ``l`` of a
group sits in *slot* ``s`` (its index in the group) and reads and writes pool tensor ``s``;
so a block id means memory in one layer of whichever group owns it. A sliding group releases
the blocks that fall wholly out of its window, so a request holds at most
``cdiv(window - 1 + chunk, block_size) + 1`` of them however long it runs.

Example, Gemma 3 270M (18 layers, 15 local with window 512, 3 global): one full group of 3
layers and five sliding groups of 3; pool blocks hold 3 layers. A model whose layers are all
alike has one group of all its layers: one tensor per layer, exactly the plain paged layout.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def first_block_in_window(position: int, window: int, block_size: int) -> int:
    """The first block a query at ``position`` (or any later one) can attend to under a
    window of ``window`` positions: a query at p sees keys at p - window + 1 .. p."""
    return max(0, position - window + 1) // block_size


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share a block table; ``sliding_window`` None means full attention."""

    layers: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None


@dataclass(frozen=True)
class KVCacheGroups:
    """The model's groups, full-attention groups first (group 0 is full when any layer is:
    a draft model or the prefix-cache events follow it)."""

    groups: tuple[KVCacheGroup, ...]

    @classmethod
    def of(cls, windows: list[int | None]) -> KVCacheGroups:
        """Group layers by their window (``windows[l]``: None for full attention)."""
        by_spec: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            by_spec.setdefault(window, []).append(layer)
        specs = sorted(by_spec, key=lambda w: (w is not None, w or 0))
        size = min(len(layers) for layers in by_spec.values())
        groups = [KVCacheGroup(tuple(by_spec[w][i:i + size]), w)
                  for w in specs for i in range(0, len(by_spec[w]), size)]
        return cls(tuple(groups))

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> KVCacheGroup:
        return self.groups[index]

    def __iter__(self):
        return iter(self.groups)

    @property
    def group_size(self) -> int:
        """Layers per pool block (the largest group; a shorter last group leaves slots unused)."""
        return max(len(g.layers) for g in self.groups)

    @property
    def has_full(self) -> bool:
        return not self.groups[0].is_sliding

    def group_of_layer(self, num_layers: int) -> list[int]:
        """``out[l]``: the group of layer ``l``."""
        out = [0] * num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return out

    def slot_of_layer(self, num_layers: int) -> list[int]:
        """``out[l]``: the pool tensor layer ``l`` uses (its index in its group)."""
        out = [0] * num_layers
        for group in self.groups:
            for slot, layer in enumerate(group.layers):
                out[layer] = slot
        return out

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int,
                   streaming_kv: tuple[int, int] | None = None) -> int:
        """Pool blocks one request of ``num_tokens`` tokens holds at most, computing up to
        ``chunk`` tokens per step: every block in a full group, the window (plus the chunk
        and a partly used block) in a sliding one; under StreamingLLM (``streaming_kv``:
        sinks, window) a full group holds its sink blocks and its window."""
        total = 0
        for group in self.groups:
            head, window = 0, group.sliding_window
            if window is None and streaming_kv is not None:
                head, window = cdiv(streaming_kv[0], block_size), streaming_kv[1]
            span = num_tokens if window is None else min(num_tokens, window - 1 + chunk)
            kept = cdiv(span, block_size) + (span < num_tokens)
            total += min(cdiv(num_tokens, block_size), head + kept)
        return total

    def max_tokens_in(self, num_blocks: int, block_size: int, chunk: int, limit: int,
                      streaming_kv: tuple[int, int] | None = None) -> int:
        """The longest request, up to ``limit`` tokens, that ``num_blocks`` pool blocks can
        hold (a model with sliding layers only holds any length in its window)."""
        low, high = 0, limit
        while low < high:  # blocks_for grows with num_tokens
            mid = (low + high + 1) // 2
            if self.blocks_for(mid, block_size, chunk, streaming_kv) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low


def kv_cache_groups(arch) -> KVCacheGroups:
    """The groups of a model (``heron.models.config.ModelArchConfig``): by each layer's
    sliding window."""
    return KVCacheGroups.of([arch.sliding_window_of(layer) for layer in range(arch.num_layers)])
