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
