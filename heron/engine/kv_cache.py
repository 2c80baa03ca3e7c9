"""Paged KV cache bookkeeping: a pool of fixed-size blocks and per-request block tables.

Allocators answer, they never decide: ``can_allocate`` / ``allocate`` report whether the
pool can hold more tokens for a request; preemption is the scheduler's call.
Blocks are ref-counted so that a prefix cache can share full blocks between requests:
a request's block table is a plain list of block ids, shared or not.
"""

from __future__ import annotations

from collections import deque

from heron.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Fixed pool of ``num_blocks`` block ids with reference counts and a free list.

    Invariant: a block is in the free list iff its ref count is 0.
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

    def share(self, block_id: int) -> None:
        """Add one more owner to an allocated block."""
        assert self.ref_counts[block_id] > 0, "sharing a free block"
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        """Drop one owner; the block returns to the free list when nobody owns it."""
        assert self.ref_counts[block_id] > 0, f"double free of block {block_id}"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._free.append(block_id)


class KVCacheManager:
    """Maps requests' token positions onto pool blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks ``request`` lacks to hold ``num_new_tokens`` more computed tokens."""
        total = request.num_computed_tokens + num_new_tokens
        return max(0, self.blocks_needed(total) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= self.pool.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow ``request.block_ids`` to cover ``num_new_tokens`` more tokens.

        Returns the newly added blocks, or None (and changes nothing) if the pool is short.
        """
        n = self.num_new_blocks(request, num_new_tokens)
        if n > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.take(n)
        request.block_ids.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (in reverse, so tails are reused last)."""
        for block_id in reversed(request.block_ids):
            self.pool.release(block_id)
        request.block_ids = []
