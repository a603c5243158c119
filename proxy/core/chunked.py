"""HTTP/1.1 chunked framing, read from bytes cut anywhere (pure; the relay's raw path uses it).

Rules:
- ``Dechunker.read`` takes one read of an engine connection and returns the chunks' data it
  completed or advanced, in order, and, once the last chunk (size 0) begins, the bytes from its
  size line on: those go back to aiohttp's parser, which reads the trailers and ends the message.
- A chunk line or a chunk's CRLF cut by a read is kept (``pending``) and joined with the next read.
- Framing that is not valid raises ``FramingError`` after the data before it was returned through
  ``pieces``: a size that is not hex, one whose value has more than 16 hex digits (leading zeros
  are allowed), a line longer than ``MAX_SIZE_LINE``, a line ended by a bare LF (refused in the
  read that carried it: nothing would ever complete it), data not followed by CRLF.
- Extensions (``;name=value``) and blanks around the size are allowed and ignored.
"""

from __future__ import annotations

HEX = b"0123456789abcdefABCDEF"
MAX_SIZE_LINE = 1024
_MAX_DIGITS = 16


class FramingError(ValueError):
    """The engine's chunked framing is malformed."""


class Dechunker:
    """The state of a chunked body read piece by piece."""

    __slots__ = ("crlf", "need", "rest")

    def __init__(self) -> None:
        self.rest = b""  # raw bytes of a chunk line or a chunk's CRLF not complete yet
        self.need = 0  # bytes of the current chunk's data still to come
        self.crlf = False  # the current chunk's data is in; its CRLF is next

    @property
    def pending(self) -> bool:
        """Whether the last read ended inside a chunk, its CRLF or a chunk line."""
        return bool(self.rest or self.need or self.crlf)

    def read(self, data: bytes, pieces: list[bytes]) -> bytes | None:
        """Append to ``pieces`` the chunk data in ``data``; the bytes from the last chunk's size
        line on once it began, else None. Raises ``FramingError`` (``pieces`` keeps what came
        before the bad framing)."""
        buf = self.rest + data if self.rest else data
        self.rest = b""
        pos, n = 0, len(buf)
        while pos < n:
            if self.need:
                take = min(self.need, n - pos)
                self.need -= take
                self.crlf = not self.need
                pieces.append(buf[pos:pos + take])
                pos += take
            elif self.crlf:
                if n - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise FramingError("a chunk's data is not followed by CRLF")
                self.crlf = False
                pos += 2
            else:
                line = buf.find(b"\r\n", pos, pos + MAX_SIZE_LINE)
                if line < 0:
                    if n - pos >= MAX_SIZE_LINE:
                        raise FramingError("a chunk line is too long")
                    if buf.find(b"\n", pos, n) >= 0:
                        raise FramingError("a chunk line ends with a bare LF")
                    break
                size = chunk_size(buf[pos:line])
                if size == 0:
                    return buf[pos:]
                self.need = size
                pos = line + 2
        self.rest = buf[pos:]
        return None


def chunk_size(line: bytes) -> int:
    """The size a chunk line (without its CRLF) gives; ``FramingError`` when it gives none."""
    head = line.split(b";", 1)[0].strip(b" \t")
    if not head or head.strip(HEX) or len(head.lstrip(b"0")) > _MAX_DIGITS:
        raise FramingError("a chunk size is not a hex number")
    return int(head, 16)
