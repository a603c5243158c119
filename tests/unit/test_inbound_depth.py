"""The body depth limit at parse: counting brackets lets most bodies skip the walk, never a deep
one."""

from __future__ import annotations

import orjson
import pytest

from proxy.core.errors import BadRequest
from proxy.core.inbound import parse_body


def nested(levels: int) -> dict[str, object]:
    """An object ``levels`` deep (the object itself is level 1), arrays and objects inside."""
    value: object = 1
    for i in range(levels - 1):
        value = {"k": value} if i % 2 else [value]
    return {"top": value}


@pytest.mark.parametrize("limit", [1, 2, 3, 8, 64])
def test_a_body_exactly_at_the_limit_passes_and_one_level_more_is_refused(limit: int) -> None:
    at = orjson.dumps(nested(limit))
    assert parse_body(at, limit)
    over = orjson.dumps(nested(limit + 1))
    with pytest.raises(BadRequest, match=f"nested more than {limit} levels"):
        parse_body(over, limit)


def test_brackets_inside_strings_do_not_make_a_shallow_body_too_deep() -> None:
    raw = orjson.dumps({"prompt": "[[[{{{" * 50, "model": "m"})
    assert parse_body(raw, 2)["model"] == "m"


def test_a_deep_body_is_refused_whatever_its_strings_hold() -> None:
    raw = orjson.dumps({"a": "x" * 1000, "b": nested(10)})
    with pytest.raises(BadRequest, match="nested more than 8 levels"):
        parse_body(raw, 8)


@pytest.mark.parametrize(("raw", "words"), [
    (b"null", "not null"), (b"[1]", "not an array"), (b'"s"', "not a string"),
    (b"1.5", "not a number"), (b"true", "not a boolean"),
    (b'{"a": 1,}', "not valid JSON (line 1, column"), (b'{"a": "\xff"}', "not valid UTF-8"),
    (b'{"a": "\xed\xa0\x80"}', "not valid UTF-8"), (b'{"a": "\\ud800"}', "not valid JSON"),
])
def test_a_body_that_is_not_an_object_is_named_in_jsons_words(raw: bytes, words: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_body(raw)
    message = str(info.value)
    assert words in message
    assert not any(name in message for name in ("NoneType", "list", "str ", "orjson", "char "))


def test_a_body_after_a_utf8_byte_order_mark_is_read_as_json() -> None:
    assert parse_body(b'\xef\xbb\xbf{"model": "m"}') == {"model": "m"}
    with pytest.raises(BadRequest, match="empty"):
        parse_body(b"\xef\xbb\xbf")
