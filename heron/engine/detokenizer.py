"""Incremental detokenization and stop-string matching, O(new tokens) per update.

Text is produced by decoding a short window of tokens and diffing it against the same window
without the newest tokens, so multi-byte characters split across tokens are only emitted once
complete (a trailing U+FFFD means "wait for more tokens"). Stop strings are searched in the
new text plus enough of the old text to catch matches that straddle token boundaries.

The text is kept as settled pieces (text no stop string can cut any more) plus a short
unsettled tail, so an update never copies the text generated so far; ``text`` joins it (once,
O(length)) for whoever wants all of it, ``text_between`` reads a recent stretch in O(stretch).
"""

from __future__ import annotations

# Prompt tokens kept as left context, so the first output token decodes with its leading space.
_CONTEXT_TOKENS = 5
# The tail is settled into a piece once it is this much longer than a stop string can reach.
_SETTLE_SLACK = 64


def safe_end(num_chars: int, sent: int, finished: bool, max_stop_len: int) -> int:
    """End of the text safe to stream, given ``sent`` characters already sent: while the
    sequence runs, hold back a tail that may be the start of a stop string (it would be cut)."""
    if finished or max_stop_len == 0:
        return num_chars
    return max(sent, num_chars - max_stop_len + 1)


def stream_safe_end(text: str, sent: int, finished: bool, max_stop_len: int) -> int:
    """``safe_end`` of ``text``."""
    return safe_end(len(text), sent, finished, max_stop_len)


class IncrementalDetokenizer:
    """Accumulates the text of one sequence; ``update`` returns the stop string hit, if any.

    ``stream_offset`` tracks what a streaming client has already been sent; ``take_stream_text``
    holds back a possible stop-string prefix until it is known not to be one.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        # only the decode window is kept: tokens before prefix_offset are dropped
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.tokens)  # tokens before this are already in the text
        self._pieces: list[str] = []  # settled text: no stop string can cut it any more
        self._settled = 0  # characters in _pieces
        self._tail = ""  # the rest of the text
        self.stream_offset = 0
        self.stopped = False

    # ---- reading the text ----------------------------------------------------------------
    @property
    def num_chars(self) -> int:
        return self._settled + len(self._tail)

    @property
    def text(self) -> str:
        """All the text so far (joins the settled pieces once: O(length))."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return (self._pieces[0] if self._pieces else "") + self._tail

    def text_between(self, start: int, end: int) -> str:
        """``text[start:end]`` in O(end - start) when ``start`` is recent."""
        end = min(end, self.num_chars)
        if start >= end:
            return ""
        if start >= self._settled:
            return self._tail[start - self._settled:end - self._settled]
        parts, pos = [], self._settled  # walk back through the pieces that cover start
        for piece in reversed(self._pieces):
            pos -= len(piece)
            parts.append(piece[max(start - pos, 0):])
            if pos <= start:
                break
        parts.reverse()
        return ("".join(parts) + self._tail)[:end - start]

    # ---- adding tokens -------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now ends the text (text is cut)."""
        self.tokens.extend(new_token_ids)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None  # incomplete UTF-8 sequence (or nothing visible yet): wait
        del self.tokens[:self.read_offset]  # the next window starts at today's read offset
        self.prefix_offset, self.read_offset = 0, len(self.tokens)
        search_from = max(0, self.num_chars - self.max_stop_len + 1)
        self._tail += full[len(prefix):]
        hit = self._check_stop(search_from) if self.stop else None
        if hit is None:
            self._settle()
        return hit

    def flush(self) -> None:
        """At finish: emit whatever is still held back (even an incomplete character)."""
        if self.stopped or self.read_offset == len(self.tokens):
            return
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        self._tail += full[len(prefix):]
        del self.tokens[:]
        self.prefix_offset = self.read_offset = 0

    def _settle(self) -> None:
        """Move the part of the tail that no later stop string can reach into a piece."""
        keep = self.max_stop_len  # a match starts at most max_stop_len - 1 before the end
        if len(self._tail) > keep + _SETTLE_SLACK:
            cut = len(self._tail) - keep
            self._pieces.append(self._tail[:cut])
            self._settled += cut
            self._tail = self._tail[cut:]

    def _check_stop(self, search_from: int) -> str | None:
        if search_from < self._settled:  # never while settling keeps max_stop_len back
            self._tail, self._pieces, self._settled = self.text, [], 0
        start = search_from - self._settled
        hit, cut = None, None
        for s in self.stop:
            i = self._tail.find(s, start)
            if i != -1 and (cut is None or i < cut):
                hit, cut = s, i
        if hit is None:
            return None
        self._tail = self._tail[:cut + len(hit)] if self.include_stop else self._tail[:cut]
        self.stopped = True
        return hit

    # ---- streaming -----------------------------------------------------------------------
    def take_stream_text(self, finished: bool) -> str:
        """New text safe to stream: when running, hold back a tail that may begin a stop string."""
        end = safe_end(self.num_chars, self.stream_offset, finished, self.max_stop_len)
        chunk = self.text_between(self.stream_offset, end)
        self.stream_offset = end
        return chunk
