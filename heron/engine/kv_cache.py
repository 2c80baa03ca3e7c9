"""Paged KV cache bookkeeping: a pool of fixed-size blocks and per-request block tables.

Allocators answer, they never decide: ``can_allocate`` / ``allocate`` report whether the
pool can hold more tokens for a request; preemption is the scheduler's call.
Blocks are ref-counted so that the prefix cache (``prefix_cache.py``) can share full blocks
between requests: a request's block table is a plain list of block ids, shared or not.

KV cache groups (``heron.models.kv_cache_spec``): a request has one table per group, all
grown together (block ``i`` of each covers the same positions) from the one pool; a
sliding-window group releases the blocks that left its window before each allocation. With
the prefix cache each group has its own tree over the same token blocks (same hashes).
"""

from __future__ import annotations

from collections import deque

from dataclasses import dataclass, field

from heron.engine.prefix_cache import HOLLOW, CacheNode, PrefixCache, chain_hash
from heron.engine.request import BlockTable, Request
from heron.models.kv_cache_spec import KVCacheGroup, KVCacheGroups, first_block_in_window

# one full-attention group (its layers are not the manager's concern)
UNIFORM = KVCacheGroups((KVCacheGroup(()),))


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


@dataclass
class PrefixHit:
    """A cached prefix of ``len(self)`` blocks a request may reuse: per group, the nodes whose
    blocks it takes (None where a sliding group's window no longer needs the block)."""

    paths: list[list[CacheNode | None]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.paths[0]) if self.paths else 0

    @property
    def last(self) -> CacheNode | None:
        """The first group's node of the last block (always held: every window needs it)."""
        return self.paths[0][-1] if len(self) else None

    def nodes(self):
        return (node for path in self.paths for node in path if node is not None)


NO_HIT = PrefixHit()


class KVCacheManager:
    """Maps requests' token positions onto pool blocks, reusing cached prefixes if enabled.

    ``hit`` arguments are what ``lookup`` returned for a request being admitted: its blocks
    become the head of the request's tables and count as computed tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 record_events: bool = False, groups: KVCacheGroups = UNIFORM) -> None:
        self.block_size = block_size
        self.groups = groups
        self.pool = BlockPool(num_blocks)
        # one tree per group; the first one's events name what a router can route on. Any
        # tree may hold released blocks inside a path (sliding groups, StreamingLLM requests):
        # it evicts unreferenced inner nodes too (least recently used first, so leaves before
        # the ancestors a request touched with them)
        self.trees = [PrefixCache(self.pool, block_size, record_events and g == 0,
                                  evict_inner=True)
                      for g in range(len(groups))] if enable_prefix_caching else []

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The first group's tree (the only one of a model whose layers are alike)."""
        return self.trees[0] if self.trees else None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to requests: free ones plus unreferenced cached ones (evictable)."""
        return self.pool.num_free_blocks + sum(t.num_unreferenced for t in self.trees)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(t) for t in self.trees)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def new_tables(self) -> list[BlockTable]:
        return [BlockTable() for _ in self.groups]

    # ---- prefix cache --------------------------------------------------------------------
    def lookup(self, request: Request) -> PrefixHit:
        """The longest cached prefix of ``request``'s tokens it may reuse: every group holds
        the blocks it needs there (a full group all of them, a sliding group its window).

        At least one token is left to compute (the step that completes the prompt must produce
        logits), and requests that want prompt logprobs compute their whole prompt.
        """
        if not self.trees or request.params.prompt_logprobs is not None:
            return NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.token_ids_between(0, max_blocks * self.block_size)
        paths = [t.match(tokens, request.cache_salt, max_blocks) for t in self.trees]
        k = min(len(p) for p in paths)
        while k > 0 and not all(self._reusable(group, path, k, request)
                                for group, path in zip(self.groups, paths)):
            k -= 1
        if k == 0:
            return NO_HIT
        return PrefixHit([[node if self._needed(group, request, i, k * self.block_size)
                           else None for i, node in enumerate(path[:k])]
                          for group, path in zip(self.groups, paths)])

    def _reusable(self, group: KVCacheGroup, path: list[CacheNode], k: int,
                  request: Request) -> bool:
        """Whether ``path``'s first ``k`` blocks hold what queries from block ``k`` on read."""
        return all(not path[i].is_hollow for i in range(k)
                   if self._needed(group, request, i, k * self.block_size))

    # ---- what a request keeps ------------------------------------------------------------
    def retention(self, group: KVCacheGroup, request: Request) -> tuple[int, int | None]:
        """(head blocks always kept, window) of ``request`` in ``group``: a sliding group keeps
        its window; a StreamingLLM request's full group its sink blocks and its window; else
        (0, None): every block."""
        if group.is_sliding:
            return 0, group.sliding_window
        streaming = request.params.streaming_kv
        if streaming is None:
            return 0, None
        sinks, window = streaming
        return cdiv(sinks, self.block_size), window

    def _needed(self, group: KVCacheGroup, request: Request, index: int, position: int) -> bool:
        """Whether a query at ``position`` (or later) of ``request`` reads block ``index``."""
        head, window = self.retention(group, request)
        return window is None or index < head or \
            index >= first_block_in_window(position, window, self.block_size)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admission's prefix-cache query and hit (tokens), for the hit rate."""
        if self.trees:
            self.trees[0].stats.queries += num_tokens
            self.trees[0].stats.hits += num_hit_tokens

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        """The token ids of block ``index`` of ``request`` (the tree's key for it)."""
        bs = self.block_size
        return tuple(request.token_ids_between(index * bs, (index + 1) * bs))

    def uncached_block_hash(self, request: Request, hit: PrefixHit | None = None) -> int | None:
        """Hash of the first full block ``request`` will compute that is not cached yet (for a
        waiting request, the one after ``hit``); None if no such block is reusable."""
        if not self.trees or request.params.prompt_logprobs is not None:
            return None
        if hit is None:
            index, parent = request.num_cached_blocks, request.last_cached_node
        else:
            index, parent = len(hit), hit.last
        if (index + 1) * self.block_size > request.num_tokens - 1:
            return None
        parent = parent or self.trees[0].root(request.cache_salt)
        return chain_hash(parent.block_hash, self._block_tokens(request, index))

    def cache_full_blocks(self, request: Request) -> None:
        """Insert the request's newly computed full blocks into each group's tree. Where an
        identical block is already cached (a sibling computed it in the same step, or an
        earlier request cached the block this one recomputed), switch to it and release the
        duplicate. Only blocks of tokens the request holds: accepted draft tokens are computed
        before they are appended."""
        if not self.trees:
            return
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full <= request.num_cached_blocks:
            return
        for i in range(request.num_cached_blocks, full):
            tokens = self._block_tokens(request, i)
            for tree, table in zip(self.trees, request.tables):
                self._cache_block(request, tree, table, i, tokens)
        request.num_cached_blocks = full

    def _cache_block(self, request: Request, tree: PrefixCache, table: BlockTable,
                     index: int, tokens: tuple[int, ...]) -> None:
        parent = table.last_cached_node or tree.root(request.cache_salt)
        own = HOLLOW if table.is_released(index) else table.block_ids[index]
        node = tree.insert(parent, tokens, own)
        if own != HOLLOW and node.block_id != own:
            tree.acquire([node])
            table.block_ids[index] = node.block_id
            self._release(tree, own)
            # the worker's table holds the released block: resend it from here
            request.num_blocks_sent = min(request.num_blocks_sent, index)
        table.last_cached_node = node

    def reset_prefix_cache(self) -> int:
        """Free every cached block no request uses; returns how many were freed."""
        return sum(t.reset() for t in self.trees)

    # ---- allocation ----------------------------------------------------------------------
    def _new_per_group(self, request: Request, num_new_tokens: int, hit: PrefixHit) -> int:
        """Blocks each group's table lacks to hold ``num_new_tokens`` more computed tokens
        (after the ``hit`` blocks, if admitting with a cache hit)."""
        total = request.num_computed_tokens + len(hit) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(total) - len(request.block_ids) - len(hit))

    def num_new_blocks(self, request: Request, num_new_tokens: int,
                       hit: PrefixHit = NO_HIT) -> int:
        """Pool blocks ``request`` lacks for ``num_new_tokens`` more tokens, over all groups."""
        return len(self.groups) * self._new_per_group(request, num_new_tokens, hit)

    def blocks_to_admit(self, request: Request, num_new_tokens: int,
                        hit: PrefixHit = NO_HIT) -> int:
        """How many available blocks admitting ``request`` consumes: new blocks, plus hit
        blocks that are cached-free now (using them takes them out of the evictable set)."""
        reused = sum(1 for node in hit.nodes() if self.pool.ref_counts[node.block_id] == 0)
        return self.num_new_blocks(request, num_new_tokens, hit) + reused

    def can_allocate(self, request: Request, num_new_tokens: int,
                     hit: PrefixHit = NO_HIT) -> bool:
        return self.blocks_to_admit(request, num_new_tokens, hit) <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int,
                 hit: PrefixHit = NO_HIT) -> list[list[int]] | None:
        """Grow the request's tables (first by the ``hit`` blocks) to cover ``num_new_tokens``
        more tokens, evicting unreferenced cached blocks if the free list is short. Sliding
        groups first release what left their windows.

        Returns the newly taken blocks per group, or None (and takes nothing) if the pool is
        short.
        """
        if len(request.tables) != len(self.groups):  # a new request: one table per group
            request.tables = self.new_tables()
        self.release_out_of_window(request)
        if not self.can_allocate(request, num_new_tokens, hit):
            return None
        n = self._new_per_group(request, num_new_tokens, hit)
        if len(hit):
            self._take_hit(request, hit)
        shortfall = n * len(self.groups) - self.pool.num_free_blocks
        for tree in reversed(self.trees):  # sliding groups' blocks go first
            if shortfall > 0:
                shortfall -= tree.evict(shortfall)
        new_blocks = []
        for table in request.tables:
            blocks = self.pool.take(n)
            table.block_ids.extend(blocks)
            new_blocks.append(blocks)
        return new_blocks

    def _take_hit(self, request: Request, hit: PrefixHit) -> None:
        for group, tree, table, path in zip(self.groups, self.trees, request.tables, hit.paths):
            held = [node for node in path if node is not None]
            tree.acquire(held)
            # blocks out of the window (between the head and it) are never taken
            table.head = self.retention(group, request)[0]
            table.num_released = len(path) - len(held)
            table.block_ids.extend(node.block_id if node else 0 for node in path)
            table.last_cached_node = path[-1]
        request.num_cached_blocks = len(hit)

    def release_out_of_window(self, request: Request) -> None:
        """Give back the blocks between each table's head and the window that no query of
        ``request`` will read again (its next query sits at ``num_computed_tokens``)."""
        for g, (group, table) in enumerate(zip(self.groups, request.tables)):
            head, window = self.retention(group, request)
            if window is None:
                continue
            table.head = head
            first = first_block_in_window(request.num_computed_tokens, window, self.block_size)
            end = min(first, len(table.block_ids))
            for i in range(head + table.num_released, end):
                self._release(self._tree(g), table.block_ids[i])
            table.num_released = max(table.num_released, end - head)

    def _tree(self, g: int) -> PrefixCache | None:
        return self.trees[g] if self.trees else None

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (in reverse, so tails are reused or evicted
        first)."""
        for g, table in enumerate(request.tables):
            for block_id in reversed(table.owned()):
                self._release(self._tree(g), block_id)
            table.clear()
        request.num_cached_blocks = 0

    def _release(self, tree: PrefixCache | None, block_id: int) -> None:
        cached = tree is not None and tree.holds(block_id)
        if self.pool.release(block_id, cached) and cached:
            tree.mark_unreferenced(block_id)
