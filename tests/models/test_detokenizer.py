"""Incremental detokenization never splits a UTF-8 character; stop strings cut exactly."""

from __future__ import annotations

import pytest

from heron.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! How are you?", "naïve café — 世界 🙂🚀 ok", "  leading spaces\n\ttab",
         "emoji 👩‍👩‍👧 family and ∑ math"]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.get_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tok, text):
    prompt = tok("Say:").input_ids
    ids = tok(text).input_ids
    detok = IncrementalDetokenizer(tok, prompt, stop=[])
    for i, token in enumerate(ids):
        detok.update([token])
        assert "\ufffd" not in detok.text, f"split character after {i + 1} tokens"
        assert text.startswith(detok.text)
    assert detok.text == tok.decode(ids)


def test_multibyte_character_is_split_across_tokens(tok):
    # the premise of the test above: some characters need several byte-level tokens
    assert any("\ufffd" in tok.decode([t]) for t in tok("🙂🚀").input_ids)


@pytest.mark.parametrize("stop,expected", [("wor", "Hello, "), ("o, w", "Hell"),
                                           ("?", "Hello, world! How are you"),
                                           ("absent", None)])
def test_stop_strings_cut_text(tok, stop, expected):
    ids = tok("Hello, world! How are you?").input_ids
    detok = IncrementalDetokenizer(tok, [], stop=[stop, "never-there"])
    hit_at = None
    for i, token in enumerate(ids):
        if detok.update([token]) is not None:
            hit_at = i
            break
    if expected is None:
        assert hit_at is None and detok.text == "Hello, world! How are you?"
    else:
        assert hit_at is not None and detok.text == expected and detok.stopped


def test_streaming_holds_back_possible_stop_prefix(tok):
    ids = tok("abc STOP def").input_ids
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    streamed = ""
    for token in ids:
        hit = detok.update([token])
        streamed += detok.take_stream_text(finished=hit is not None)
        assert "STO" not in streamed
        if hit:
            break
    assert streamed == detok.text == "abc "


def test_flush_emits_incomplete_tail(tok):
    ids = tok("🙂").input_ids
    detok = IncrementalDetokenizer(tok, [], stop=[])
    detok.update(ids[:1])
    assert detok.text == ""
    detok.flush()
    assert detok.text == tok.decode(ids[:1])


class _Chars:
    """A tokenizer whose token i is the i-th word of a fixed list (no model needed)."""

    WORDS = ["a", "b", "cd", " ", "STOP", "ST", "OP", "xyz", "\n", "é"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.WORDS[i] for i in ids)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("stop", [[], ["STOP"], ["b cd", "xyzxyz"], ["a"]])
def test_long_text_settles_without_changing_what_is_seen(seed, stop):
    """Hundreds of tokens: text, text_between, streaming and stop cuts equal plain string
    arithmetic on the decoded text, while the detokenizer keeps only a short tail unsettled."""
    import random

    rng = random.Random(seed)
    ids = [rng.randrange(len(_Chars.WORDS)) for _ in range(600)]
    detok = IncrementalDetokenizer(_Chars(), [], stop=stop)
    streamed, hit, n = "", None, 0
    for n, token in enumerate(ids, 1):
        hit = detok.update([token])
        streamed += detok.take_stream_text(finished=hit is not None)
        if hit:
            break
        assert len(detok._tail) <= detok.max_stop_len + 64 + 4
        assert len(detok.tokens) <= 2  # only the decode window is kept
    streamed += detok.take_stream_text(finished=True)  # the end: nothing is held back now
    full = _Chars().decode(ids[:n])
    if hit is not None:
        full = full[:full.index(hit)]
    assert detok.text == streamed == full and detok.num_chars == len(full)
    assert (hit is not None) == any(s in _Chars().decode(ids) for s in stop)
    for start, end in ((0, len(full)), (len(full) // 2, len(full) - 3), (len(full) - 70, None)):
        end = len(full) if end is None else end
        assert detok.text_between(max(start, 0), end) == full[max(start, 0):end]
