"""Paged KV cache bookkeeping: a pool of fixed-size blocks and per-request block tables.

Allocators answer, they never decide: ``can_allocate`` / ``allocate`` report whether the
pool can hold more tokens for a request; preemption is the scheduler's call.
Blocks are ref-counted so that the prefix cache (``prefix_cache.py``) can share full blocks
between requests: a request's block table is a plain list of block ids, shared or not.
"""

from __future__ import annotations

from collections import deque

from heron.engine.prefix_cache import CacheNode, PrefixCache, chain_hash
from heron.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Fixed pool of ``num_blocks`` block ids with reference counts and a free list.

    A block's ref count is the number of requests using it. Invariant: a block is in the free
    list iff its ref count is 0 and no prefix cache holds it (a cached block with ref count 0
    stays out of the free list until the cache evicts it).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each). The caller checked there are enough."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def retain(self, block_id: int) -> None:
        """Add one more owner to an allocated or cached block."""
        self.ref_counts[block_id] += 1

    def release(self, block_id: int, cached: bool = False) -> bool:
        """Drop one owner; returns True when that was the last one. The block then returns
        to the free list, unless it is ``cached`` (the prefix cache frees it on eviction)."""
        assert self.ref_counts[block_id] > 0, f"double free of block {block_id}"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] > 0:
            return False
        if not cached:
            self._free.append(block_id)
        return True

    def free_block(self, block_id: int) -> None:
        """Return an unreferenced block that the prefix cache no longer holds."""
        assert self.ref_counts[block_id] == 0, f"freeing block {block_id} that is in use"
        self._free.append(block_id)


class KVCacheManager:
    """Maps requests' token positions onto pool blocks, reusing cached prefixes if enabled.

    ``hit`` arguments are the cached nodes ``lookup`` returned for a request being admitted:
    their blocks become the head of its block table and count as computed tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 record_events: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = (PrefixCache(self.pool, block_size, record_events)
                             if enable_prefix_caching else None)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to requests: free ones plus unreferenced cached ones (evictable)."""
        cached_free = self.prefix_cache.num_unreferenced if self.prefix_cache else 0
        return self.pool.num_free_blocks + cached_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def lookup(self, request: Request) -> list[CacheNode]:
        """Cached nodes for the longest prefix of ``request``'s tokens it may reuse.

        At least one token is left to compute (the step that completes the prompt must produce
        logits), and requests that want prompt logprobs compute their whole prompt.
        """
        if self.prefix_cache is None or request.params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.token_ids_between(0, max_blocks * self.block_size)
        return self.prefix_cache.match(tokens, request.cache_salt, max_blocks)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admission's prefix-cache query and hit (tokens), for the hit rate."""
        if self.prefix_cache is not None:
            self.prefix_cache.stats.queries += num_tokens
            self.prefix_cache.stats.hits += num_hit_tokens

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        """The token ids of block ``index`` of ``request`` (the tree's key for it)."""
        bs = self.block_size
        return tuple(request.token_ids_between(index * bs, (index + 1) * bs))

    def uncached_block_hash(self, request: Request,
                            hit: list[CacheNode] | None = None) -> int | None:
        """Hash of the first full block ``request`` will compute that is not cached yet (for a
        waiting request, the one after ``hit``); None if no such block is reusable."""
        if self.prefix_cache is None or request.params.prompt_logprobs is not None:
            return None
        if hit is None:
            index, parent = request.num_cached_blocks, request.last_cached_node
        else:
            index, parent = len(hit), (hit[-1] if hit else None)
        if (index + 1) * self.block_size > request.num_tokens - 1:
            return None
        parent = parent or self.prefix_cache.root(request.cache_salt)
        return chain_hash(parent.block_hash, self._block_tokens(request, index))

    def cache_full_blocks(self, request: Request) -> None:
        """Insert the request's newly computed full blocks into the tree. Where an identical
        block is already cached (a sibling computed it in the same step, or an earlier request
        cached the block this one recomputed), switch to it and release the duplicate. Only
        blocks of tokens the request holds: accepted draft tokens are computed before they
        are appended."""
        if self.prefix_cache is None:
            return
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        parent = request.last_cached_node or self.prefix_cache.root(request.cache_salt)
        for i in range(request.num_cached_blocks, full):
            own = request.block_ids[i]
            node = self.prefix_cache.insert(parent, self._block_tokens(request, i), own)
            if node.block_id != own:
                self.prefix_cache.acquire([node])
                request.block_ids[i] = node.block_id
                self._release(own)
                # the worker's table holds the released block: resend it from here
                request.num_blocks_sent = min(request.num_blocks_sent, i)
            parent = node
        if full > request.num_cached_blocks:
            request.num_cached_blocks, request.last_cached_node = full, parent

    def reset_prefix_cache(self) -> int:
        """Free every cached block no request uses; returns how many were freed."""
        return self.prefix_cache.reset() if self.prefix_cache else 0

    # ---- allocation ----------------------------------------------------------------------
    def num_new_blocks(self, request: Request, num_new_tokens: int,
                       hit: list[CacheNode] = ()) -> int:
        """Blocks ``request`` lacks to hold ``num_new_tokens`` more computed tokens (after the
        ``hit`` blocks, if admitting with a cache hit)."""
        total = request.num_computed_tokens + len(hit) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(total) - len(request.block_ids) - len(hit))

    def blocks_to_admit(self, request: Request, num_new_tokens: int,
                        hit: list[CacheNode] = ()) -> int:
        """How many available blocks admitting ``request`` consumes: new blocks, plus hit
        blocks that are cached-free now (using them takes them out of the evictable set)."""
        reused = sum(1 for node in hit if self.pool.ref_counts[node.block_id] == 0)
        return self.num_new_blocks(request, num_new_tokens, hit) + reused

    def can_allocate(self, request: Request, num_new_tokens: int,
                     hit: list[CacheNode] = ()) -> bool:
        return self.blocks_to_admit(request, num_new_tokens, hit) <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int,
                 hit: list[CacheNode] = ()) -> list[int] | None:
        """Grow ``request.block_ids`` (first by the ``hit`` blocks) to cover ``num_new_tokens``
        more tokens, evicting unreferenced cached blocks if the free list is short.

        Returns the newly taken blocks, or None (and changes nothing) if the pool is short.
        """
        if not self.can_allocate(request, num_new_tokens, hit):
            return None
        n = self.num_new_blocks(request, num_new_tokens, hit)
        if hit:
            self.prefix_cache.acquire(hit)
            request.block_ids.extend(node.block_id for node in hit)
            request.num_cached_blocks, request.last_cached_node = len(hit), hit[-1]
        shortfall = n - self.pool.num_free_blocks
        if shortfall > 0:
            self.prefix_cache.evict(shortfall)
        new_blocks = self.pool.take(n)
        request.block_ids.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (in reverse, so tails are reused or evicted
        first)."""
        for block_id in reversed(request.block_ids):
            self._release(block_id)
        request.block_ids = []
        request.num_cached_blocks, request.last_cached_node = 0, None

    def _release(self, block_id: int) -> None:
        cached = self.prefix_cache is not None and self.prefix_cache.holds(block_id)
        if self.pool.release(block_id, cached) and cached:
            self.prefix_cache.mark_unreferenced(block_id)
