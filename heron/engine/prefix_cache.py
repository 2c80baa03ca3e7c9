"""Radix tree over full KV blocks: reuse the KV of a cached prefix across requests.

Each node below a root is one full block of ``block_size`` token ids and the pool block that
holds their KV, computed after exactly the token path from the root (children are keyed by
the tuple of their block's tokens, so edges are page-aligned). One root per cache salt keeps
tenants apart. A node's ``block_hash`` chains its parent's hash, the salt and its tokens, so
anyone who knows the token ids can name a block (the KV events a router consumes).

Ownership: the pool's ref count of a block counts the *requests* using it; the tree holds no
reference. A cached block with ref count 0 is "cached-free": reusable by the next match, and
reclaimable by eviction. Eviction takes unreferenced leaves in LRU order (a logical clock,
bumped when a block is matched or released). Invariant: the ancestors of a referenced node are
referenced (a request uses its whole path), so unreferenced nodes form whole subtrees at the
fringe and leaf-first eviction can reclaim every one of them.

Sliding-window groups (``evict_inner``, one tree per KV cache group, ``kv_cache.py``): a running
request gives back the blocks that left its window, so unreferenced nodes sit inside paths
too. Such a tree evicts any unreferenced node: a leaf is removed, an inner node is *hollowed*
(its block freed, ``block_id`` HOLLOW, kept as a link so its descendants stay reachable). A
match may pass through hollow nodes; the KV manager reuses a prefix only where every block
its window needs is still held.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from dataclasses import dataclass, field

from heron.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

BlockKey = tuple[int, ...]
HOLLOW = -1  # the block id of a root, and of a node whose block was evicted (sliding trees)


def chain_hash(parent_hash: int, tokens: BlockKey) -> int:
    """The hash of a block: its parent's hash and its token ids (a stable 64-bit digest)."""
    data = parent_hash.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root_hash(salt: str | None) -> int:
    """The hash a salt's chain starts from (0 without a salt)."""
    if salt is None:
        return 0
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def block_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list[int]:
    """Hashes of the full blocks of ``token_ids``, as the cache names them in KV events."""
    hashes, parent = [], root_hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class CacheNode:
    """One cached full block (or a root, or a hollow link: ``block_id == HOLLOW``)."""

    tokens: BlockKey
    block_id: int
    block_hash: int
    parent: CacheNode | None = None
    children: dict[BlockKey, CacheNode] = field(default_factory=dict)
    last_access: int = 0
    # unlinked by eviction (hollow, childless) while a request may still extend it: the
    # next insert under it links its token path back into the tree
    detached: bool = False

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_hollow(self) -> bool:
        return self.block_id == HOLLOW


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens found in the cache


class PrefixCache:
    """The tree, its LRU eviction order and its event log. Works on a ``BlockPool``."""

    def __init__(self, pool, block_size: int, record_events: bool = False,
                 evict_inner: bool = False) -> None:
        self.pool = pool
        self.evict_inner = evict_inner
        self.block_size = block_size
        self.roots: dict[str | None, CacheNode] = {}
        self.nodes: dict[int, CacheNode] = {}  # block id -> node (hollow nodes: not here)
        self.num_unreferenced = 0  # cached-free blocks (ref count 0)
        self._evictable: list[tuple[int, int]] = []  # heap of (last_access, block id), lazy
        self._clock = itertools.count(1)
        self.record_events = record_events
        self.events: list[KVEvent] = []
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self.nodes)

    def holds(self, block_id: int) -> bool:
        return block_id in self.nodes

    def root(self, salt: str | None) -> CacheNode:
        if salt not in self.roots:
            self.roots[salt] = CacheNode((), HOLLOW, root_hash(salt))
        return self.roots[salt]

    # ---- lookup --------------------------------------------------------------------------
    def match(self, token_ids: list[int], salt: str | None, max_blocks: int) -> list[CacheNode]:
        """The nodes of the longest cached prefix of ``token_ids``, at most ``max_blocks``.

        Read-only: nothing is referenced until ``acquire``. Hollow nodes are part of the path.
        """
        node, path, bs = self.root(salt), [], self.block_size
        for i in range(max_blocks):
            node = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
            if node is None:
                break
            path.append(node)
        return path

    def acquire(self, nodes: list[CacheNode]) -> None:
        """Add one request reference to each node's block."""
        now = next(self._clock)
        for node in nodes:
            if self.pool.ref_counts[node.block_id] == 0:
                self.num_unreferenced -= 1
            self.pool.retain(node.block_id)
            node.last_access = now

    # ---- insertion -----------------------------------------------------------------------
    def insert(self, parent: CacheNode, tokens: BlockKey, block_id: int) -> CacheNode:
        """Cache ``block_id`` (holding ``tokens``, referenced by its writer) under ``parent``.

        If an identical block is already cached there, returns that node instead and caches
        nothing: the caller switches to the cached block and releases its own copy. A hollow
        node there takes ``block_id``. ``block_id`` HOLLOW (a sliding group's block the
        request already gave back) adds only the link.
        """
        if parent.detached:
            parent = self._reattached(parent)
        node = parent.children.get(tokens)
        if node is None:
            node = CacheNode(tokens, HOLLOW, chain_hash(parent.block_hash, tokens), parent,
                             last_access=next(self._clock))
            parent.children[tokens] = node
        if node.is_hollow and block_id != HOLLOW:
            node.block_id = block_id
            self.nodes[block_id] = node
            if self.record_events:
                parent_hash = None if parent.is_root else parent.block_hash
                self.events.append(BlockStored([node.block_hash], parent_hash, list(tokens),
                                               self.block_size))
        return node

    def _reattached(self, node: CacheNode) -> CacheNode:
        """The tree's node for ``node``'s token path: the detached nodes on the way linked
        back (as they are: hollow), or the node that took their place meanwhile."""
        chain = []
        while node.detached:
            chain.append(node)
            node = node.parent
        for lost in reversed(chain):  # ``node`` is in the tree
            live = node.children.get(lost.tokens)
            if live is None:
                lost.parent, lost.detached = node, False
                node.children[lost.tokens] = live = lost
            node = live
        return node

    def mark_unreferenced(self, block_id: int) -> None:
        """The last request using this cached block let it go: it becomes cached-free."""
        node = self.nodes[block_id]
        self.num_unreferenced += 1
        node.last_access = next(self._clock)
        if not node.children or self.evict_inner:
            heapq.heappush(self._evictable, (node.last_access, block_id))

    # ---- eviction ------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Return up to ``num_blocks`` unreferenced blocks to the pool, least recently used
        leaves first; returns how many were freed."""
        freed = 0
        while freed < num_blocks and self._evictable:
            stamp, block_id = heapq.heappop(self._evictable)
            node = self.nodes.get(block_id)
            if node is None or node.last_access != stamp or self.pool.ref_counts[block_id] > 0 \
                    or (node.children and not self.evict_inner):
                continue  # stale entry: re-used, re-stamped, evicted or no longer a leaf
            self._free_block_of(node)
            if not node.children:
                self._unlink(node)
            freed += 1
        return freed

    def _free_block_of(self, node: CacheNode) -> None:
        """Give the node's unreferenced block back to the pool; the node becomes hollow."""
        del self.nodes[node.block_id]
        self.num_unreferenced -= 1
        self.pool.free_block(node.block_id)
        node.block_id = HOLLOW
        if self.record_events:
            self.events.append(BlockRemoved([node.block_hash]))

    def _unlink(self, node: CacheNode) -> None:
        """Remove a hollow leaf, and the hollow ancestors it leaves childless; a parent that
        becomes an unreferenced leaf turns evictable."""
        parent = node.parent
        del parent.children[node.tokens]
        node.detached = True
        if parent.is_root or parent.children:
            return
        if parent.is_hollow:
            self._unlink(parent)
        elif self.pool.ref_counts[parent.block_id] == 0 and not self.evict_inner:
            heapq.heappush(self._evictable, (parent.last_access, parent.block_id))

    def reset(self) -> int:
        """Evict every unreferenced block; referenced ones stay cached. Returns the count."""
        freed = self.evict(self.num_unreferenced)
        if self.record_events and not self.nodes:
            self.events.append(AllBlocksCleared())
        return freed

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
