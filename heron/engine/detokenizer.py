"""Incremental detokenization and stop-string matching.

Text is produced by decoding a short window of tokens and diffing it against the same window
without the newest tokens, so multi-byte characters split across tokens are only emitted once
complete (a trailing U+FFFD means "wait for more tokens"). Stop strings are searched in the
new text plus enough of the old text to catch matches that straddle token boundaries.
"""

from __future__ import annotations

# Prompt tokens kept as left context, so the first output token decodes with its leading space.
_CONTEXT_TOKENS = 5


def stream_safe_end(text: str, sent: int, finished: bool, max_stop_len: int) -> int:
    """End of the text safe to stream, given ``sent`` characters already sent: while the
    sequence runs, hold back a tail that may be the start of a stop string (it would be cut)."""
    if finished or max_stop_len == 0:
        return len(text)
    return max(sent, len(text) - max_stop_len + 1)


class IncrementalDetokenizer:
    """Accumulates ``text`` for one sequence; ``update`` returns the stop string hit, if any.

    ``stream_offset`` tracks what a streaming client has already been sent; ``take_stream_text``
    holds back a possible stop-string prefix until it is known not to be one.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.tokens)  # tokens before this are already in `text`
        self.text = ""
        self.stream_offset = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now ends the text (text is cut)."""
        self.tokens.extend(new_token_ids)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None  # incomplete UTF-8 sequence (or nothing visible yet): wait
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += new_text
        return self._check_stop(start)

    def flush(self) -> None:
        """At finish: emit whatever is still held back (even an incomplete character)."""
        if self.stopped or self.read_offset == len(self.tokens):
            return
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.tokens)

    def _check_stop(self, search_from: int) -> str | None:
        hit, cut = None, None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (cut is None or i < cut):
                hit, cut = s, i
        if hit is None:
            return None
        self.text = self.text[:cut + len(hit)] if self.include_stop else self.text[:cut]
        self.stopped = True
        return hit

    def take_stream_text(self, finished: bool) -> str:
        """New text safe to stream: when running, hold back a tail that may begin a stop string."""
        end = stream_safe_end(self.text, self.stream_offset, finished,
                              max((len(s) for s in self.stop), default=0))
        chunk = self.text[self.stream_offset:end]
        self.stream_offset = end
        return chunk
