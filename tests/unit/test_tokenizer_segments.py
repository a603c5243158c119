"""Encoding a rendered chat piece by piece between added tokens, with the pieces kept, gives the
ids of encoding it whole (``proxy.fleet.tokenizer``), and is turned off where it would not."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_files import SPECIAL, make_tokenizer_dir
from tokenizers import Tokenizer, models, pre_tokenizers

from proxy.fleet.tokenizer import MIN_CACHED_CHARS, PromptTokenizer, SegmentCache, load_tokenizer


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
    assert not prompt.segmented
    assert prompt.encode("a b<s>a b", special=False) == tok.encode(
        "a b<s>a b", add_special_tokens=False).ids


def test_a_tokenizer_without_added_tokens_is_encoded_whole() -> None:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert not PromptTokenizer(tok, None).segmented
    assert SPECIAL  # the BPE above has them: it is the one that is segmented
