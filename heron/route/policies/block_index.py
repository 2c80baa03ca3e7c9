"""Per-worker sets of the KV block hashes a worker holds, rebuilt from its KV events.

Block hashes chain (``heron.engine.prefix_cache.chain_hash``): the i-th hash of a prompt names
its whole token prefix up to block i, under its cache salt. So "how much of this prompt does
the worker have cached" is the length of the longest run of the prompt's hashes, from the
first, that the worker's set holds; a hash missing in the middle ends the match (the engine
matches prefixes the same way).

Two kinds of entries:
- *confirmed*: from ``BlockStored`` events, removed by ``BlockRemoved`` / ``AllBlocksCleared``;
- *speculative*: the blocks of a request the router just sent there (``add_speculative``),
  which the worker will store once it runs the prefill. They bridge the time until the events
  arrive (a burst of requests sharing a new prefix then follows the first one) and expire
  after ``ttl_s`` unless an event confirms them.
"""

from __future__ import annotations

import time

from heron.engine.prefix_cache import chain_hash, root_hash

SPECULATIVE_TTL_S = 10.0
MAX_SPECULATIVE = 200_000  # bound on the speculative entries of one worker
MAX_MEMO = 200_000  # remembered block hashes (a tenant's system prompt is hashed once)

# (parent hash, block tokens) -> chain_hash of them: exact, it is the same function, and a
# tuple lookup costs far less than a blake2b over bytes built token by token
_hash_memo: dict[tuple[int, tuple[int, ...]], int] = {}


def cached_block_hashes(token_ids: list[int], block_size: int,
                        salt: str | None = None) -> list[int]:
    """``prefix_cache.block_hashes``, memoized per block."""
    if len(_hash_memo) > MAX_MEMO:
        _hash_memo.clear()
    hashes, parent = [], root_hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = (parent, tuple(token_ids[start:start + block_size]))
        h = _hash_memo.get(key)
        if h is None:
            h = _hash_memo[key] = chain_hash(*key)
        hashes.append(h)
        parent = h
    return hashes


class BlockIndex:
    """The block hashes one worker holds, as its events tell them.

    Invariant: ``confirmed`` is exactly the set of hashes stored and not since removed or
    cleared, among the events applied since the last ``clear`` (a subscriber clears on a gap,
    so after a gap the set under-reports: a missed hit, never a wrong one). ``speculative``
    maps hashes to their expiry (monotonic seconds) and never holds a confirmed hash.
    """

    def __init__(self, block_size: int, speculative_ttl_s: float = SPECULATIVE_TTL_S) -> None:
        self.block_size = block_size
        self.ttl_s = speculative_ttl_s
        self.confirmed: set[int] = set()
        self.speculative: dict[int, float] = {}
        self.events_applied = 0
        self.clears = 0

    def __len__(self) -> int:
        return len(self.confirmed)

    # ---- events --------------------------------------------------------------------------
    def apply(self, event: dict) -> None:
        """Apply one decoded event (``kv_events.event_to_dict`` shape); unknown types ignored."""
        kind = event.get("type")
        if kind == "BlockStored":
            for h in event.get("block_hashes", ()):
                self.confirmed.add(h)
                self.speculative.pop(h, None)
        elif kind == "BlockRemoved":
            for h in event.get("block_hashes", ()):
                self.confirmed.discard(h)
                self.speculative.pop(h, None)
        elif kind == "AllBlocksCleared":
            self.confirmed.clear()
            self.speculative.clear()
        else:
            return
        self.events_applied += 1

    def clear(self) -> None:
        """Forget everything (a sequence gap or a restarted worker)."""
        self.confirmed.clear()
        self.speculative.clear()
        self.clears += 1

    def add_speculative(self, hashes: list[int], now: float | None = None) -> None:
        """The worker is about to store these blocks (a request was routed there)."""
        if len(self.speculative) > MAX_SPECULATIVE:
            self.expire(now)
            if len(self.speculative) > MAX_SPECULATIVE:
                return  # still full of live entries: stop guessing, the events will tell
        expiry = (time.monotonic() if now is None else now) + self.ttl_s
        for h in hashes:
            if h not in self.confirmed:
                self.speculative[h] = expiry

    def expire(self, now: float | None = None) -> int:
        """Drop speculative entries past their expiry; returns how many."""
        now = time.monotonic() if now is None else now
        dead = [h for h, t in self.speculative.items() if t <= now]
        for h in dead:
            del self.speculative[h]
        return len(dead)

    # ---- lookup --------------------------------------------------------------------------
    def holds(self, h: int, now: float) -> bool:
        if h in self.confirmed:
            return True
        expiry = self.speculative.get(h)
        return expiry is not None and expiry > now

    def matched_blocks(self, hashes: list[int], now: float | None = None) -> int:
        """How many of ``hashes`` (a prompt's chained block hashes), from the first, this
        worker holds."""
        now = time.monotonic() if now is None else now
        n = 0
        for h in hashes:
            if not self.holds(h, now):
                break
            n += 1
        return n


class PromptHashes:
    """A prompt's chained block hashes, computed once per block size and shared by every
    worker scored for the same request."""

    def __init__(self, token_ids: list[int], salt: str | None) -> None:
        self.token_ids = token_ids
        self.salt = salt
        self._by_size: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def for_block_size(self, block_size: int) -> list[int]:
        hashes = self._by_size.get(block_size)
        if hashes is None:
            hashes = cached_block_hashes(self.token_ids, block_size, self.salt)
            self._by_size[block_size] = hashes
        return hashes

    def cached_tokens(self, index: BlockIndex, now: float | None = None) -> int:
        """Prompt tokens the worker behind ``index`` would reuse: its leading held blocks,
        at most ``(len - 1) // block_size`` of them (the engine always computes the last
        prompt token, ``KVCacheManager``'s match limit)."""
        bs = index.block_size
        hashes = self.for_block_size(bs)[:max(len(self.token_ids) - 1, 0) // bs]
        return index.matched_blocks(hashes, now) * bs
