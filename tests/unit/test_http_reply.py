"""The HTTP/1.1 reply reader the scraper frames ``/metrics`` replies with: every framing, fed
whole and byte by byte, and every bound."""

from __future__ import annotations

import pytest

from proxy.core.http_reply import MAX_HEADERS, BadReply, ReplyReader, ReplyTooLarge

BODY = b"vllm:num_requests_running 1\n" * 10


def reader(max_body: int = 4096, max_head: int = 1024) -> ReplyReader:
    return ReplyReader(max_head=max_head, max_body=max_body)


def feed_all(raw: bytes, *, split: int = 0, **kw: int) -> ReplyReader:
    """Feed ``raw`` whole (``split`` 0) or in pieces of ``split`` bytes; the reader when done."""
    r = reader(**kw)
    pieces = [raw] if not split else [raw[i : i + split] for i in range(0, len(raw), split)]
    done = False
    for piece in pieces:
        assert not done
        done = r.feed(piece)
    assert done and r.done
    return r


def sized(body: bytes = BODY, head: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), head, body)


def chunked(body: bytes = BODY, size: int = 7, ext: bytes = b"", trailer: bytes = b"") -> bytes:
    parts = [b"%x%s\r\n%s\r\n" % (len(body[i : i + size]), ext, body[i : i + size])
             for i in range(0, len(body), size)]
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(parts)
            + b"0\r\n" + trailer + b"\r\n")


@pytest.mark.parametrize("split", [0, 1, 5, 64])
@pytest.mark.parametrize("raw", [sized(), chunked(), chunked(ext=b";x=1", trailer=b"X-T: 1\r\n")],
                         ids=["length", "chunked", "chunked_ext_trailer"])
def test_a_framed_reply_reads_whole_or_in_pieces_and_keeps_the_connection(
    raw: bytes, split: int
) -> None:
    r = feed_all(raw, split=split)
    assert (r.status, r.body, r.keep_alive) == (200, BODY, True)


def test_a_reply_without_length_runs_until_the_connection_closes() -> None:
    r = reader()
    assert not r.feed(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + BODY[:50])
    assert not r.feed(BODY[50:])
    assert r.feed_eof() and r.body == BODY and not r.keep_alive


@pytest.mark.parametrize("head", [b"HTTP/1.0 200 OK", b"HTTP/1.1 200 OK\r\nConnection: close",
                                  b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close"])
def test_a_reply_that_ends_the_connection_says_so(head: bytes) -> None:
    r = feed_all(head + b"\r\nContent-Length: 2\r\n\r\nok")
    assert r.body == b"ok" and not r.keep_alive


def test_interim_replies_are_skipped_a_few_at_most() -> None:
    r = feed_all(b"HTTP/1.1 100 Continue\r\n\r\n" + sized())
    assert (r.status, r.body) == (200, BODY)
    with pytest.raises(BadReply, match="interim"):
        reader().feed(b"HTTP/1.1 103 Early Hints\r\n\r\n" * 5 + sized())


def test_the_status_is_known_from_the_head_alone() -> None:
    r = reader()
    assert not r.feed(b"HTTP/1.1 302 Found\r\nLocation: http://elsewhere/\r\nContent-Length: 9")
    assert r.status is None
    assert not r.feed(b"\r\n\r\n")
    assert r.status == 302


def test_a_declared_oversized_body_is_refused_from_the_head() -> None:
    r = reader(max_body=100)
    with pytest.raises(ReplyTooLarge):
        r.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 101\r\n\r\n")
    assert r.status == 200


@pytest.mark.parametrize("raw", [chunked(BODY * 4), chunked(BODY * 4, size=1000)])
def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_bound(raw: bytes) -> None:
    r = reader(max_body=len(BODY) * 2)
    with pytest.raises(ReplyTooLarge):
        for i in range(0, len(raw), 16):
            r.feed(raw[i : i + 16])
    assert len(r.body) <= len(BODY) * 2


def test_a_body_until_close_is_refused_past_the_bound() -> None:
    r = reader(max_body=64)
    r.feed(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64)
    with pytest.raises(ReplyTooLarge):
        r.feed(b"x")


def test_an_endless_head_is_refused_at_its_bound() -> None:
    r = reader(max_head=256)
    r.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(BadReply, match="head longer"):
        for _ in range(100):
            r.feed(b"X-Pad: " + b"a" * 20 + b"\r\n")


def test_too_many_header_fields_are_refused() -> None:
    head = b"HTTP/1.1 200 OK\r\n" + b"X: 1\r\n" * (MAX_HEADERS + 1) + b"\r\n"
    with pytest.raises(BadReply, match="header fields"):
        reader(max_head=64 * 1024).feed(head)


@pytest.mark.parametrize("raw", [
    b"HTTP/2 200 OK\r\n\r\n",
    b"HTTP/1.1 20 OK\r\n\r\n",
    b"ICY 200 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: 1\r\n folded\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nBad Name: 1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 0x10\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"0" * 40 + b"1\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokSURPLUS",
], ids=["version", "status", "protocol", "no_colon", "folded", "bad_name", "two_lengths",
        "negative_length", "hex_length", "other_coding", "bad_chunk_size", "long_chunk_size",
        "no_crlf_after_chunk", "surplus"])
def test_malformed_framing_is_refused(raw: bytes) -> None:
    with pytest.raises(BadReply):
        reader().feed(raw)


def test_an_endless_chunk_size_line_is_refused() -> None:
    r = reader()
    r.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(BadReply, match="line too long"):
        for _ in range(100):
            r.feed(b"0" * 64)


def test_endless_trailers_are_refused() -> None:
    r = reader(max_head=256)
    r.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n")
    with pytest.raises(BadReply, match="trailers"):
        for _ in range(100):
            r.feed(b"X-T: " + b"a" * 20 + b"\r\n")


@pytest.mark.parametrize("raw", [sized()[:-3], chunked()[:-5], b"HTTP/1.1 200 OK\r\n"])
def test_a_reply_cut_short_is_refused_at_the_close(raw: bytes) -> None:
    r = reader()
    assert not r.feed(raw)
    with pytest.raises(BadReply, match="closed"):
        r.feed_eof()


def test_bytes_after_a_complete_reply_are_refused() -> None:
    r = feed_all(sized())
    with pytest.raises(BadReply, match="after the end"):
        r.feed(b"HTTP/1.1 200 OK\r\n")


def test_an_empty_body_completes_with_the_head() -> None:
    r = reader()
    assert r.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert r.body == b"" and r.keep_alive
