"""Chunked framing read from reads cut anywhere: the data comes out whole and in order, the last
chunk is handed back from its size line on, and bad framing is refused after the data before it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.chunked import MAX_SIZE_LINE, Dechunker, FramingError, chunk_size


def _frame(payload: bytes, line: bytes | None = None) -> bytes:
    return (line if line is not None else b"%x" % len(payload)) + b"\r\n" + payload + b"\r\n"


def _read_all(body: bytes, cuts: list[int]) -> tuple[bytes, bytes | None]:
    reader, pieces, last = Dechunker(), [], None
    bounds = [0, *sorted(set(cuts)), len(body)]
    for a, b in itertools.pairwise(bounds):
        if last is not None:
            break
        last = reader.read(body[a:b], pieces)
        if last is not None:
            last += body[b:]  # the parser gets what follows the read too
    return b"".join(pieces), last


@given(st.lists(st.binary(min_size=1, max_size=40), max_size=8), st.data())
def test_any_cut_of_a_chunked_body_gives_its_data_and_hands_back_the_last_chunk(
    payloads: list[bytes], data: st.DataObject
) -> None:
    last_chunk = b"0\r\nX-Trailer: 1\r\n\r\n"
    body = b"".join(_frame(p) for p in payloads) + last_chunk
    cuts = data.draw(st.lists(st.integers(1, len(body) - 1), max_size=12))
    got, last = _read_all(body, cuts)
    assert got == b"".join(payloads)
    assert last == last_chunk


@pytest.mark.parametrize("line", [b"A", b"a ; name=value", b" a\t", b"000000000000000000000a",
                                  b"a;x"])
def test_sizes_with_extensions_blanks_and_leading_zeros_are_read_as_their_value(
    line: bytes,
) -> None:
    assert chunk_size(line) == 10
    got, last = _read_all(_frame(b"0123456789", line) + b"0\r\n\r\n", [3, 9])
    assert (got, last) == (b"0123456789", b"0\r\n\r\n")


@pytest.mark.parametrize(("body", "before"), [
    (_frame(b"ok") + b"zz\r\nabc\r\n", b"ok"),  # not hex
    (_frame(b"ok") + b"1" * 17 + b"\r\n", b"ok"),  # a value past 16 hex digits
    (_frame(b"ok") + b"3\r\nabcX\r\n", b"okabc"),  # data not followed by CRLF
    (_frame(b"ok") + b"3\nabc", b"ok"),  # a bare LF ends the size line
    (_frame(b"ok") + b"1" * MAX_SIZE_LINE, b"ok"),  # a size line that never ends
    (b"\r\n", b""),  # an empty size line
])
def test_bad_framing_is_refused_after_the_data_before_it(body: bytes, before: bytes) -> None:
    reader, pieces = Dechunker(), []
    with pytest.raises(FramingError):
        reader.read(body, pieces)
    assert b"".join(pieces) == before


def test_a_size_line_cut_by_the_read_waits_for_the_rest() -> None:
    reader, pieces = Dechunker(), []
    assert reader.read(b"1", pieces) is None and reader.pending and pieces == []
    assert reader.read(b"0\r", pieces) is None and reader.pending
    assert reader.read(b"\n0123456789abcdef\r", pieces) is None and reader.pending
    assert reader.read(b"\n", pieces) is None and not reader.pending
    assert b"".join(pieces) == b"0123456789abcdef"
