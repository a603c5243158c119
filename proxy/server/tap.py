"""The engine connection while a body is read: its reads handed to whoever relays them.

Rules:
- ``TappedReader``: a body reader whose parser callbacks go to a ``Sink`` (the splice) instead of
  being buffered; ``SPENT`` is the inert sink a pooled connection's reader keeps afterwards.
- ``tap_connection`` puts an ``_UpstreamTap`` between aiohttp's protocol and the connection: reads
  go where the tapper says, everything else to aiohttp's protocol, and the connection's loss is
  told to the tapper too (aiohttp's C parser drops a body whose framing it refused without ending
  its reader).
- ``BodyWatch`` uses the same tap for an answer read whole, so a broken body ends at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, cast

from aiohttp import ClientPayloadError
from aiohttp.helpers import _EXC_SENTINEL as _NO_CAUSE
from aiohttp.streams import StreamReader


class Sink(Protocol):
    """What a tapped reader hands its body to (``proxy.server.splice.Splice``)."""

    chunk_open: bool

    def feed(self, data: bytes) -> None: ...

    def end(self, failure: BaseException | None) -> None: ...


class TappedReader(StreamReader):
    """A body reader whose parser callbacks hand the bytes to a ``Splice`` (its ``_protocol``)."""

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        self._protocol.feed(data)  # type: ignore[attr-defined]  # the Splice (no cast per event)
        return False

    # No reader keeps chunk offsets; the splice learns whether the parser stopped inside a chunk
    # (its raw path may take over only between two chunks).
    def begin_http_chunk_receiving(self) -> None:
        self._protocol.chunk_open = True  # type: ignore[attr-defined]

    def end_http_chunk_receiving(self) -> None:
        self._protocol.chunk_open = False  # type: ignore[attr-defined]

    def feed_eof(self) -> None:
        super().feed_eof()  # runs the response's EOF callbacks: the connection goes to its pool
        cast(Sink, self._protocol).end(None)

    def set_exception(self, exc: BaseException, exc_cause: BaseException = _NO_CAUSE) -> None:
        super().set_exception(exc, exc_cause)
        cast(Sink, self._protocol).end(exc)


class BodyWatch:
    """Watches an engine connection while a plain (not spliced) answer is read whole: if the
    connection is lost with the body unfinished and its reader not ended (aiohttp's C parser,
    having refused the framing, drops the reader), the reader is failed so the read ends now,
    not at its timeout. ``release`` hands the connection back to aiohttp's protocol."""

    __slots__ = ("_original", "_reader", "_transport")

    def __init__(self, reader: StreamReader) -> None:
        self._reader: StreamReader | None = reader
        proto = reader._protocol
        self._original: Any = proto
        self._transport = tap_connection(proto, proto.data_received, self._lost)

    def _lost(self) -> None:
        reader = self._reader
        if reader is not None and not reader.is_eof() and reader.exception() is None:
            reader.set_exception(ClientPayloadError(
                "the engine's connection closed before the answer ended"))

    def release(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None and not transport.is_closing():
            transport.set_protocol(self._original)
        self._reader = self._original = None


def tap_connection(proto: object, received: Callable[[bytes], None],
                    lost: Callable[[], None]) -> asyncio.Transport | None:
    """Put an ``_UpstreamTap`` between aiohttp's protocol ``proto`` and its engine connection;
    the connection, or None when there is none that can be tapped."""
    transport = getattr(proto, "transport", None)
    if transport is None or not hasattr(transport, "set_protocol"):
        return None
    transport.set_protocol(_UpstreamTap(received, cast(asyncio.Protocol, proto), lost))
    return cast(asyncio.Transport, transport)


class _Spent:
    """What an engine connection's body reader reports to once its tap has ended: nothing. The
    pooled connection keeps its last reader until it is reused; pointing that reader here lets
    the ended stream's state (splice, client connection, captured bytes) go at once instead of
    living on, and being scanned by the collector, for as long as the connection idles."""

    __slots__ = ()

    def feed(self, data: bytes) -> None:
        pass

    def end(self, failure: BaseException | None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass

    @property
    def chunk_open(self) -> bool:
        return True

    @chunk_open.setter
    def chunk_open(self, value: bool) -> None:
        pass


class _UpstreamTap(asyncio.Protocol):
    """Stands in for aiohttp's protocol on the engine connection while a body is read: the reads
    go to ``received`` (the splice's, or aiohttp's own), everything else to aiohttp's protocol,
    and once that protocol has taken the connection's loss, ``lost`` is told. aiohttp's C parser
    drops a body whose framing it refused without ending its reader (the connection closes, the
    reader waits for ever); ``lost`` ends it."""

    def __init__(self, received: Callable[[bytes], None], original: asyncio.Protocol,
                 lost: Callable[[], None]) -> None:
        self.data_received = received  # type: ignore[method-assign,assignment]  # no frame between
        self._original = original
        self._lost = lost

    def connection_lost(self, exc: Exception | None) -> None:
        self._original.connection_lost(exc)
        self._lost()

    def eof_received(self) -> bool | None:
        return self._original.eof_received()

    def pause_writing(self) -> None:
        self._original.pause_writing()

    def resume_writing(self) -> None:
        self._original.resume_writing()


SPENT = _Spent()
