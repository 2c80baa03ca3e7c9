"""Encode a chat template's text piece by piece, remembering the long pieces.

``tokenizers`` splits its input on added tokens (``<|im_start|>``, ``<|im_end|>``, ...) before
it normalizes, pre-tokenizes and runs the model on each piece in between, so the ids of a text
are the concatenation of its pieces' ids. Requests of a tenant share their system prompt: its
piece is encoded once and reused, and a request costs the tokens of its new pieces only (a
long prompt costs milliseconds to encode on a busy CPU; the router pays that on every request).

Exactness: only when every added token matches as a plain string (no ``lstrip`` / ``rstrip`` /
``single_word``, not matched after normalization) and the pre-tokenizer does not treat the
start of the whole text specially (ByteLevel, Split, Digits, Punctuation, Whitespace: yes;
Metaspace with ``prepend_scheme: first``: no). Otherwise :func:`segment_encoder` returns None
and the caller encodes whole texts. The first calls are also checked against a whole-text
encode; a mismatch turns the cache off for good.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict

logger = logging.getLogger("heron.route")

SAFE_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace",
                       "WhitespaceSplit"}
MIN_CACHED_CHARS = 64  # shorter pieces are cheap to encode again
MAX_ENTRIES = 4096
CHECKED_CALLS = 16  # the first calls are compared with a whole-text encode


def _pre_tokenizer_types(spec) -> list[str]:
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [t for p in spec.get("pretokenizers", []) for t in _pre_tokenizer_types(p)]
    return [spec.get("type")]


def _plain_added_tokens(tokenizer, has_normalizer: bool) -> dict[str, int] | None:
    """content -> id of the added tokens, or None if any matches other than as a string."""
    tokens = {}
    for token_id, token in tokenizer.get_added_tokens_decoder().items():
        if token.lstrip or token.rstrip or token.single_word or (token.normalized
                                                                 and has_normalizer):
            return None
        tokens[token.content] = token_id
    return tokens


class SegmentEncoder:
    """Encodes text without special tokens as ``tokenizer.encode(text,
    add_special_tokens=False).ids`` does, with an LRU of long pieces' ids.

    Invariant: a piece is either an added token's exact text (its id) or text with no added
    token in it (encoded alone, as ``tokenizers`` encodes it inside the whole text).
    """

    def __init__(self, tokenizer, added: dict[str, int]) -> None:
        self._tokenizer = tokenizer
        self._added = added
        # leftmost, then longest (alternatives sorted longest first), like tokenizers' matcher
        alternatives = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") \
            if alternatives else None
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._checks_left = CHECKED_CALLS
        self.enabled = True

    def encode(self, text: str) -> list[int]:
        if not self.enabled or self._split is None:
            return self._whole(text)
        ids = []
        for piece in self._split.split(text):
            if piece:
                ids.extend(self._piece(piece))
        if self._checks_left > 0:
            self._checks_left -= 1
            whole = self._whole(text)
            if whole != ids:
                logger.warning("route tokenizer: piecewise encoding differs from the whole "
                               "text's; encoding whole texts from now on")
                self.enabled = False
                return whole
        return ids

    def _whole(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def _piece(self, piece: str) -> list[int]:
        token_id = self._added.get(piece)
        if token_id is not None:
            return [token_id]
        if len(piece) < MIN_CACHED_CHARS:
            return self._whole(piece)
        ids = self._cache.get(piece)
        if ids is not None:
            self._cache.move_to_end(piece)
            return ids
        ids = self._cache[piece] = self._whole(piece)
        if len(self._cache) > MAX_ENTRIES:
            self._cache.popitem(last=False)
        return ids


def segment_encoder(tokenizer) -> SegmentEncoder | None:
    """A piecewise encoder for ``tokenizer`` (a ``tokenizers.Tokenizer``), or None when its
    configuration could make pieces encode differently inside the whole text."""
    if getattr(tokenizer, "encode_special_tokens", False):
        return None  # added tokens are not split out: nothing to cut the text at
    spec = json.loads(tokenizer.to_str())
    types = _pre_tokenizer_types(spec.get("pre_tokenizer"))
    if any(t not in SAFE_PRE_TOKENIZERS for t in types):
        return None
    added = _plain_added_tokens(tokenizer, spec.get("normalizer") is not None)
    if added is None:
        return None
    return SegmentEncoder(tokenizer, added)
