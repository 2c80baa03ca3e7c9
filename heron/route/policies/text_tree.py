"""An approximate prefix cache of one worker: a character-level radix tree of the prompts the
router sent it (SGLang's cache-aware guess, for workers that publish no KV events).

Each edge holds a non-empty string; a node's children are keyed by their edge's first
character, so at most one child can continue a given text. ``size`` counts the characters on
all edges. ``evict(max_size)`` removes least recently used leaves until the tree fits: a
prompt the worker served long ago has likely left its KV cache too.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("edge", "children", "parent", "last_access")

    def __init__(self, edge: str, parent: _Node | None, last_access: int) -> None:
        self.edge = edge
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last_access = last_access


def _common_prefix_len(text: str, start: int, edge: str) -> int:
    """Length of the common prefix of ``text[start:]`` and ``edge``."""
    if text.startswith(edge, start):
        return len(edge)
    n = min(len(edge), len(text) - start)
    lo, hi = 0, n  # binary search on slice equality: C-speed compares, log(n) of them
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text[start:start + mid] == edge[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class TextTree:
    """Character radix tree with LRU leaf eviction.

    Invariants: no edge is empty except the root's; a non-root node with one child and no
    prompt ending there may exist (splits are not merged back; harmless for matching); a
    node's ``last_access`` is at least each descendant's (a touch stamps the whole path), so
    leaves are always the least recently used of their subtree and leaf-first eviction is LRU.
    """

    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self.root = _Node("", None, 0)
        self.size = 0  # characters on all edges

    def insert(self, text: str) -> None:
        """Add ``text`` (its whole path becomes most recently used)."""
        now, node, pos = next(self._clock), self.root, 0
        node.last_access = now
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node.children[text[pos]] = _Node(text[pos:], node, now)
                self.size += len(text) - pos
                return
            k = _common_prefix_len(text, pos, child.edge)
            if k < len(child.edge):
                child = self._split(child, k)
            child.last_access = now
            node, pos = child, pos + k

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` characters; returns the new upper node."""
        parent = child.parent
        upper = _Node(child.edge[:k], parent, child.last_access)
        parent.children[upper.edge[0]] = upper
        child.edge = child.edge[k:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def match(self, text: str) -> int:
        """Characters of the longest prefix of ``text`` the tree holds (read-only)."""
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            k = _common_prefix_len(text, pos, child.edge)
            pos += k
            if k < len(child.edge):
                break
            node = child
        return pos

    def evict(self, max_size: int) -> int:
        """Remove least recently used leaves until ``size <= max_size``; returns the
        characters removed. A leaf's removal may turn its parent into the next leaf."""
        if self.size <= max_size:
            return 0
        before, tie = self.size, itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.size > max_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return before - self.size

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def clear(self) -> None:
        self.root = _Node("", None, 0)
        self.size = 0
