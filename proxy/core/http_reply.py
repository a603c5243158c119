"""One HTTP/1.1 response read from bytes as they arrive: the status, the few headers that frame
it, and a body delimited by Content-Length, chunked transfer coding or the end of the connection.

Rules (pure: no I/O, no clock; the caller feeds what its socket received):
- Only what a client of ``/metrics`` needs. The reply is hostile input, so everything is bounded:
  the head (status line and headers) within ``max_head`` bytes and ``MAX_HEADERS`` lines, the
  body within ``max_body`` bytes, a chunk-size line within ``_MAX_LINE`` bytes, the trailers
  within ``max_head``. Nothing past a bound is kept.
- A body larger than ``max_body`` raises ``ReplyTooLarge``: at once, from the head, when its
  Content-Length says so; else as soon as the bytes received pass the bound.
- Anything that does not frame a reply unambiguously raises ``BadReply`` (a malformed status line
  or header, a folded header, two different Content-Lengths, a transfer coding other than chunked,
  a bad chunk size, a connection closed mid-reply): the bytes after it could not be trusted to
  frame the next reply either, so the caller closes the connection.
- Interim (1xx) replies before the final one are skipped, at most ``_MAX_INTERIM`` of them.
- ``keep_alive`` says whether the connection may carry another request once the reply is
  complete: HTTP/1.1, no ``Connection: close``, a body framed by length or chunks.
"""

from __future__ import annotations

import re
from enum import Enum

MAX_HEADERS = 100
_MAX_LINE = 1024
_MAX_INTERIM = 4
_STATUS = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\r\n]*)?")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class BadReply(Exception):
    """The bytes do not frame an HTTP/1.1 reply (the message says how, without the bytes)."""


class ReplyTooLarge(Exception):
    """The reply's body is larger than the bound."""


class _Phase(Enum):
    HEAD = "head"
    LENGTH = "length"  # body of a known length
    CHUNK_SIZE = "chunk_size"
    CHUNK_DATA = "chunk_data"
    CHUNK_END = "chunk_end"  # the CRLF after a chunk's data
    TRAILERS = "trailers"
    UNTIL_CLOSE = "until_close"
    DONE = "done"


class ReplyReader:
    """Feed it a response's bytes (``feed``, then ``feed_eof`` if the peer closes); ``done``
    once the reply is complete, with ``status``, ``body`` and ``keep_alive``."""

    def __init__(self, *, max_head: int, max_body: int) -> None:
        self.max_head = max_head
        self.max_body = max_body
        self.status: int | None = None  # the final reply's, once its head is read
        self.keep_alive = False
        self._phase = _Phase.HEAD
        self._buf = bytearray()
        self._body = bytearray()
        self._left = 0  # bytes still due in a length-framed body or the current chunk
        self._interim = 0

    @property
    def done(self) -> bool:
        return self._phase is _Phase.DONE

    @property
    def body(self) -> bytes:
        return bytes(self._body)

    def feed(self, data: bytes) -> bool:
        """Take the bytes received; True once the reply is complete. Bytes past the end of the
        reply (a server that answers more than asked) are a ``BadReply``."""
        if self._phase is _Phase.DONE:
            raise BadReply("data after the end of the reply")
        if self._phase is _Phase.LENGTH and not self._buf:
            return self._length(data)  # the usual case: no copy into the buffer first
        self._buf += data
        while self._buf and self._step():
            pass
        if self.done and self._buf:
            raise BadReply("data after the end of the reply")
        return self.done

    def feed_eof(self) -> bool:
        """The peer closed the connection: the end of a body read until close, else a
        reply cut short."""
        if self._phase is _Phase.UNTIL_CLOSE:
            self._phase = _Phase.DONE
            return True
        if self._phase is not _Phase.DONE:
            raise BadReply("connection closed before the reply was complete")
        return True

    # -- one step per phase; each returns whether it consumed something and may go on

    def _step(self) -> bool:
        phase = self._phase
        if phase is _Phase.HEAD:
            return self._head()
        if phase is _Phase.LENGTH:
            data, self._buf = bytes(self._buf), bytearray()
            self._length(data)
            return False
        if phase is _Phase.CHUNK_SIZE:
            return self._chunk_size()
        if phase is _Phase.CHUNK_DATA:
            return self._chunk_data()
        if phase is _Phase.CHUNK_END:
            return self._chunk_end()
        if phase is _Phase.TRAILERS:
            return self._trailers()
        if phase is _Phase.UNTIL_CLOSE:
            self._take(bytes(self._buf))
            self._buf.clear()
            return False
        return False

    def _head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > self.max_head:
                raise BadReply(f"reply head longer than {self.max_head} bytes")
            return False
        if end + 4 > self.max_head:
            raise BadReply(f"reply head longer than {self.max_head} bytes")
        head = bytes(self._buf[:end])
        del self._buf[: end + 4]
        status, version_1_1, fields = _parse_head(head)
        if 100 <= status < 200:
            self._interim += 1
            if self._interim > _MAX_INTERIM:
                raise BadReply("too many interim replies")
            return True
        self.status = status
        self._frame(version_1_1, fields)
        return True

    def _frame(self, version_1_1: bool, fields: dict[bytes, bytes]) -> None:
        """How the body is delimited, from the final reply's head."""
        connection = {t.strip() for t in fields.get(b"connection", b"").lower().split(b",")}
        self.keep_alive = version_1_1 and b"close" not in connection
        coding = fields.get(b"transfer-encoding")
        if coding is not None:
            if coding.strip().lower() != b"chunked":
                raise BadReply("unsupported transfer coding")
            self._phase = _Phase.CHUNK_SIZE
            return
        length = fields.get(b"content-length")
        if length is None:
            self.keep_alive = False
            self._phase = _Phase.UNTIL_CLOSE
            return
        self._left = _content_length(length)
        if self._left > self.max_body:
            raise ReplyTooLarge(f"body larger than {self.max_body} bytes")
        self._phase = _Phase.LENGTH if self._left else _Phase.DONE

    def _length(self, data: bytes) -> bool:
        if len(data) > self._left:
            raise BadReply("data after the end of the reply")
        self._body += data
        self._left -= len(data)
        if not self._left:
            self._phase = _Phase.DONE
        return self._phase is _Phase.DONE

    def _chunk_size(self) -> bool:
        line = self._line()
        if line is None:
            return False
        size = line.split(b";", 1)[0].strip()
        if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
            raise BadReply("bad chunk size")
        self._left = int(size, 16)
        if len(self._body) + self._left > self.max_body:
            raise ReplyTooLarge(f"body larger than {self.max_body} bytes")
        self._phase = _Phase.CHUNK_DATA if self._left else _Phase.TRAILERS
        return True

    def _chunk_data(self) -> bool:
        take = min(self._left, len(self._buf))
        self._body += self._buf[:take]
        del self._buf[:take]
        self._left -= take
        if self._left:
            return False
        self._phase = _Phase.CHUNK_END
        return True

    def _chunk_end(self) -> bool:
        if len(self._buf) < 2:
            return False
        if self._buf[:2] != b"\r\n":
            raise BadReply("chunk not followed by CRLF")
        del self._buf[:2]
        self._phase = _Phase.CHUNK_SIZE
        return True

    def _trailers(self) -> bool:
        while (line := self._line(self.max_head)) is not None:
            if not line:
                self._phase = _Phase.DONE
                return False
            # Trailers are read and dropped; their total is bounded like a head's.
            self._left += len(line) + 2
            if self._left > self.max_head:
                raise BadReply(f"trailers longer than {self.max_head} bytes")
        return False

    def _line(self, limit: int = _MAX_LINE) -> bytes | None:
        end = self._buf.find(b"\r\n")
        if end < 0:
            if len(self._buf) > limit:
                raise BadReply("line too long")
            return None
        if end > limit:
            raise BadReply("line too long")
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def _take(self, data: bytes) -> None:
        if len(self._body) + len(data) > self.max_body:
            raise ReplyTooLarge(f"body larger than {self.max_body} bytes")
        self._body += data


def _parse_head(head: bytes) -> tuple[int, bool, dict[bytes, bytes]]:
    """(status, whether HTTP/1.1, header fields by lower-case name) of a reply's head."""
    lines = head.split(b"\r\n")
    match = _STATUS.fullmatch(lines[0])
    if match is None:
        raise BadReply("malformed status line")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadReply(f"more than {MAX_HEADERS} header fields")
    fields: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise BadReply("malformed header field")  # a folded line starts with a space too
        key, value = name.lower(), value.strip(b" \t")
        if key == b"content-length" and fields.get(key, value) != value:
            raise BadReply("conflicting Content-Length")
        fields[key] = value if key not in fields or key == b"content-length" else (
            fields[key] + b", " + value)
    return int(match.group(2)), match.group(1) == b"1", fields


def _content_length(value: bytes) -> int:
    if not value.isdigit() or len(value) > 18:
        raise BadReply("bad Content-Length")
    return int(value)
