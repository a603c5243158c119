"""Encoding a rendered chat piece by piece between added tokens, and a long piece span by span,
with the pieces and spans kept, gives the ids of encoding it whole (``proxy.fleet.tokenizer``),
and is turned off where it would not."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_files import SPECIAL, make_tokenizer_dir
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from proxy.fleet.tokenizer import (
    AUDIT_EVERY,
    MIN_CACHED_CHARS,
    SPAN_CHARS,
    PromptTokenizer,
    SegmentCache,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    return load_tokenizer(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))), "tokenizer")


# Text with what trips tokenizers up: spaces and newlines at the edges, punctuation, non-ASCII,
# and the added tokens themselves inside a message.
_TEXT = st.lists(st.one_of(st.sampled_from(["the ", "engine", " ", "  ", "\n", "\n\n", ".", "é",
                                            "prefix ", "cache", "<s>", "</s>", "<|user|>", "<|"]),
                           st.text(max_size=5)), max_size=120).map("".join)
_MESSAGES = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), _TEXT),
                     min_size=1, max_size=6)


@given(_MESSAGES, st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_piecewise_ids_are_the_whole_texts_ids(bpe: PromptTokenizer,
                                               messages: list[tuple[str, str]],
                                               repeat: int) -> None:
    assert bpe.segmented
    body = {"messages": [{"role": r, "content": c * repeat} for r, c in messages]}
    text = bpe._template.render(  # type: ignore[union-attr]
        messages=body["messages"], add_generation_prompt=True, bos_token="<s>")
    whole = bpe._whole(text, False)
    assert bpe.request_ids(True, body) == whole
    assert bpe.request_ids(True, body) == whole  # again, from the kept pieces


def test_a_resent_history_is_encoded_once(bpe: PromptTokenizer) -> None:
    history = "the router learns what each engine holds " * 20
    first = {"messages": [{"role": "user", "content": history}]}
    second = {"messages": [{"role": "user", "content": history},
                           {"role": "assistant", "content": "a shared system prompt " * 12},
                           {"role": "user", "content": "engines publish"}]}
    before = len(bpe.cache)
    bpe.request_ids(True, first)
    assert len(bpe.cache) == before + 1
    assert bpe.cache.get(history) is not None  # the piece between two added tokens
    assert bpe.request_ids(True, second) == bpe._whole(
        bpe._template.render(messages=second["messages"], add_generation_prompt=True,  # type: ignore[union-attr]
                             bos_token="<s>"), False)


def test_the_cache_is_bounded_in_characters() -> None:
    cache = SegmentCache(max_chars=3 * MIN_CACHED_CHARS)
    pieces = [str(i) * MIN_CACHED_CHARS for i in range(5)]
    for n, piece in enumerate(pieces):
        cache.put(piece, [n])
    assert cache.chars <= 3 * MIN_CACHED_CHARS and len(cache) == 3
    assert cache.get(pieces[0]) is None and cache.get(pieces[4]) == [4]
    cache.put("x" * (4 * MIN_CACHED_CHARS), [9])  # larger than the whole cache: not kept
    assert len(cache) == 3


def test_a_tokenizer_that_treats_a_texts_start_specially_is_encoded_whole(
        tmp_path: Path) -> None:
    # A Metaspace prefix is added only at the very start of a text: a piece encoded alone would
    # get one that the whole text does not have there, so the probe turns pieces off.
    vocab = {"[UNK]": 0, "<s>": 1, "▁a": 2, "a": 3, "▁": 4, "▁b": 5, "b": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.add_special_tokens(["<s>"])
    prompt = PromptTokenizer(tok, None)
    assert not prompt.segmented and not prompt.spans
    assert prompt.encode("a b<s>a b", special=False) == tok.encode(
        "a b<s>a b", add_special_tokens=False).ids


def test_a_tokenizer_without_added_tokens_is_not_segmented_but_spans_long_texts() -> None:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, ".": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    prompt = PromptTokenizer(tok, None)
    assert not prompt.segmented and prompt.spans
    assert SPECIAL  # the BPE above has them: it is the one that is segmented
    text = " ".join(f"a{i}." if i % 7 == 0 else f"b{i}" for i in range(3000))
    assert prompt.encode(text, special=False) == tok.encode(text, add_special_tokens=False).ids
    assert len(prompt.cache) >= len(text) // SPAN_CHARS - 2  # the spans before the last kept


# Long texts: words, numbers and punctuation with single and repeated gaps, newlines, non-ASCII.
_LONG = st.lists(st.sampled_from(["the", "engine", "Cache", "x", "42", "1234567", ",", ".", "'s",
                                  "é", "naïve", " ", " ", " ", "  ", "\n", "\n\n", "\t", "-"]),
                 min_size=600, max_size=1500).map("".join)


@given(_LONG, st.sampled_from(["", "user: ", "<|user|>q "]))
@settings(max_examples=60, deadline=None)
def test_spanned_ids_are_the_whole_texts_ids(bpe: PromptTokenizer, words: str,
                                             head: str) -> None:
    assert bpe.spans
    text = head + (words * (1 + 4 * SPAN_CHARS // max(1, len(words))))[: 5 * SPAN_CHARS]
    whole = bpe._whole(text, False)
    assert bpe.encode(text, special=False) == whole
    assert bpe.encode(text, special=False) == whole  # again, from the kept spans
    assert bpe.encode(text + " and more", special=False) == bpe._whole(text + " and more", False)


def test_a_shared_document_is_encoded_once(bpe: PromptTokenizer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    document = " ".join(f"engine{i % 97} holds block {i}" for i in range(2000))
    assert len(document) > 10 * SPAN_CHARS
    first = {"messages": [{"role": "user", "content": document + " What is held?"}]}
    second = {"messages": [{"role": "user", "content": document + " Where is block 7?"}]}
    bpe.request_ids(True, first)
    encoded: list[int] = []
    real = bpe._tok

    class Counting:
        def encode_batch_fast(self, texts: list[str], **kw: object) -> object:
            encoded.extend(len(t) for t in texts)
            return real.encode_batch_fast(texts, **kw)

    monkeypatch.setattr(bpe, "_tok", Counting())
    ids = bpe.request_ids(True, second)
    monkeypatch.undo()
    rendered = bpe._template.render(  # type: ignore[union-attr]
        messages=second["messages"], add_generation_prompt=True, bos_token="<s>")
    assert ids == bpe._whole(rendered, False)
    # Only the last span and the short pieces around the message were encoded again (and the
    # whole piece, when this is a checked one).
    again = [n for n in encoded if n < len(document)]
    assert sum(again) < 2 * SPAN_CHARS + 64
    assert len(encoded) - len(again) <= 1


def test_spans_that_encode_differently_are_turned_off_and_the_whole_ids_returned(
        caplog: pytest.LogCaptureFixture) -> None:
    # One token crosses a word gap ("zz y"), and no probe has it: the probe agrees, the check
    # while serving does not.
    vocab = {"[UNK]": 0, "zz y": 1, "zz": 2, "y": 3, " ": 4, "w": 5, "b": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("zz y|\\w+"), behavior="isolated")
    prompt = PromptTokenizer(tok, None)
    assert prompt.spans
    for n in range(AUDIT_EVERY):  # the first is checked; the next check is the crossing one
        plain = f"b{n} " + "b " * (3 * SPAN_CHARS)  # each with a span to encode
        assert prompt.encode(plain, special=False) == tok.encode(plain).ids
    again = "b0 " + "b " * (3 * SPAN_CHARS)  # every span kept: not counted
    assert prompt.encode(again, special=False) == tok.encode(again).ids
    crossing = "w" * (SPAN_CHARS - 3) + " zz y" + " b" * SPAN_CHARS  # the first gap past
    # the span's length is the one inside "zz y"
    whole = tok.encode(crossing).ids
    assert 1 in whole
    assert prompt.encode(crossing, special=False) == whole
    assert not prompt.spans
    assert "spans off" in caplog.text
    assert prompt.encode(crossing, special=False) == whole
