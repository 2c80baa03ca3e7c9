"""The approximate prefix tree of `heron route`'s cache_aware policy (pure, no I/O).

Oracle: the longest common prefix between a text and any inserted text still held; sizes
count the distinct characters of the trie of the held texts.
"""

from __future__ import annotations

import os

from hypothesis import given, settings, strategies as st

from heron.route.policies.text_tree import TextTree, _common_prefix_len


def _lcp(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _trie_size(texts) -> int:
    """Characters in a trie of ``texts`` = distinct non-empty prefixes."""
    return len({t[:i] for t in texts for i in range(1, len(t) + 1)})


def test_match_and_split():
    tree = TextTree()
    tree.insert("system: be nice. user: hi")
    tree.insert("system: be nice. user: bye")
    assert tree.match("system: be nice. user: hello") == len("system: be nice. user: h")
    assert tree.match("system: be nice. user: bye") == len("system: be nice. user: bye")
    assert tree.match("other") == 0 and tree.match("") == 0
    assert tree.size == _trie_size(["system: be nice. user: hi", "system: be nice. user: bye"])


def test_common_prefix_len():
    assert _common_prefix_len("abcdef", 2, "cdx") == 2
    assert _common_prefix_len("abc", 1, "bcdef") == 2
    assert _common_prefix_len("abc", 0, "abc") == 3
    assert _common_prefix_len("abc", 0, "x") == 0


def test_eviction_is_lru_by_leaf():
    tree = TextTree()
    tree.insert("aaaa-old")
    tree.insert("bbbb-new")
    tree.insert("aaaa-recent")  # the shared "aaaa-" path is recent now, "old" is not
    removed = tree.evict(tree.size - 1)
    assert removed == len("old")
    assert tree.match("aaaa-old") == len("aaaa-")
    assert tree.match("aaaa-recent") == len("aaaa-recent")
    assert tree.match("bbbb-new") == len("bbbb-new")


def test_evict_to_zero_and_clear():
    tree = TextTree()
    for i in range(20):
        tree.insert(f"prompt {i} " * 3)
    tree.evict(0)
    assert tree.size == 0 and tree.match("prompt 1") == 0
    tree.insert("x")
    tree.clear()
    assert tree.size == 0 and not tree.root.children


texts = st.lists(st.text(alphabet="ab c", max_size=12), max_size=12)


@settings(max_examples=150, deadline=None)
@given(texts, st.text(alphabet="ab c", max_size=14))
def test_match_is_the_longest_common_prefix(inserted, query):
    tree = TextTree()
    for t in inserted:
        tree.insert(t)
    assert tree.match(query) == max((_lcp(query, t) for t in inserted), default=0)
    assert tree.size == _trie_size(inserted)


@settings(max_examples=150, deadline=None)
@given(texts, st.integers(0, 40))
def test_eviction_keeps_the_most_recent_texts(inserted, budget):
    """After evict(budget): size <= budget, the tree still describes a trie (sizes add up),
    and whatever remains of a text is a prefix of it; the last text inserted loses nothing
    unless the budget cannot hold even it."""
    tree = TextTree()
    for t in inserted:
        tree.insert(t)
    tree.evict(budget)
    assert tree.size <= budget
    held = _collect(tree)
    assert tree.size == _trie_size(held)
    for text in held:
        assert any(t.startswith(text) for t in inserted)
    if inserted and len(inserted[-1]) <= budget:
        assert tree.match(inserted[-1]) == len(inserted[-1])


def _collect(tree: TextTree) -> list[str]:
    """The root-to-leaf texts the tree holds."""
    out, stack = [], [(child, child.edge) for child in tree.root.children.values()]
    while stack:
        node, text = stack.pop()
        if not node.children:
            out.append(text)
        stack.extend((c, text + c.edge) for c in node.children.values())
    return out
