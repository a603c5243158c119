"""The per-event path of a streamed answer: engine connection to client transport, in callbacks.

Rules:
- After the first body byte (read the ordinary way, under the first-byte budget) the body's
  ``StreamReader`` is turned into a tap: aiohttp's C parser still does the engine side's HTTP
  framing (chunked or sized), and each piece of body it decodes goes straight from that callback
  to the client's transport, framed for the client (chunked, or as is for HTTP/1.0). No task wakes
  per event and no coroutine runs; the relay's coroutine sleeps until the stream ends or the
  client's buffer fills.
- Flow control both ways: when a write leaves the client's transport above its high-water mark
  (the transport pauses the server protocol), reading from the engine pauses (the parser keeps
  what it has not decoded, the socket stops being read) until the client's buffer drains below its
  low-water mark. Memory per stream is bounded by the transport's high-water mark plus one read.
- One idle deadline per stream: a single ``call_at`` timer, re-armed only when it fires, from the
  time of the last read; while the client holds the stream up, the engine is not idle. The
  client's deadline is a second single timer. Nothing is scheduled per event.
- Writes: the first piece decoded at a tick of the loop's clock (a millisecond under uvloop) is
  written at once; more pieces at the same tick (one engine read that held several events, or a
  burst) are joined and written once by a callback queued behind the current ones, and always
  before anything else is written or the tap ends. A read holding k events costs two writes, not
  k; a stream paced slower than the tick costs nothing extra.
- The raw path: when the engine's body and the client's are both chunked, the splice stands in
  for aiohttp's protocol on the engine connection (``transport.set_protocol``). Reads still go to
  the parser until one ends between two chunks (the parser's last callback ended a chunk and the
  read ends with that chunk's CRLF); from then on each read that is whole chunks is written to the
  client as it came, framing and all, one write for the read, with no parser and no callback per
  chunk. Anything else (a chunk or chunk line cut by the read, the usage event to strip, an event
  split across chunks, the last chunk) is taken apart here and each chunk's data goes through
  ``feed``, as the parser would have sent it. The last chunk, and any trailers, go back to
  aiohttp's protocol, which still stands between two chunks and so ends the message and pools the
  connection. Framing that is not valid (a bad size, a chunk line past ``MAX_SIZE_LINE``, data not
  followed by CRLF) fails the stream; an ended stream gives the connection back unfinished, so it
  is closed, never reused.
- Per read, only: the time, the byte count (KV commitments), a reference kept in a short tail
  (usage at the end), the usage strip's substring check when the proxy asked for usage, and, for
  a request that may be recorded, a bounded list of references (``Capture``; dropped past its
  limit); the raw path keeps each chunk's data as a slice instead. Recording and usage parsing
  happen once, at the end.
- The engine's bytes are never re-encoded: the client gets each decoded piece as it came, less a
  usage event the proxy asked for on the client's behalf.
- The tap ends once: at the engine's EOF, its failure, an idle or deadline timeout, the client
  going away, or ``cut`` (drain). After that no byte is written by the tap; the relay writes the
  ending (error event or the last chunk) through the response object. The engine connection's
  reader then reports to an inert stand-in, so a pooled connection keeps nothing of the stream.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any, cast

from aiohttp import ClientPayloadError, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import StreamReader

from proxy.core.chunked import HEX, MAX_SIZE_LINE, Dechunker, FramingError
from proxy.core.commitment import Flight
from proxy.core.usage import StreamTail, UsageStrip
from proxy.server.tap import SPENT, TappedReader, tap_connection


class DeadlinePassed(TimeoutError):
    """The client's deadline, not one of the proxy's own limits, ran out."""


class Capture:
    """The engine's bytes kept for a recorder, by reference, up to ``limit`` bytes in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.chunks: list[bytes] = []
        self.overflowed = False

    def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.overflowed:
            return
        if self.size > self.limit:
            self.overflowed = True  # past what may be stored: nothing more is worth keeping
            self.chunks.clear()
            return
        self.chunks.append(data)


_PENDING: Any = object()
# The context the tap's own callbacks (its timers, the held write) run in. They read and set no
# context variable, and a callback scheduled without one copies the current context: one more
# object per timer for the collector to track, as long as the stream is open.
_QUIET = contextvars.Context()


class Splice:
    """Relays one stream's body from the engine's connection to the client's transport."""

    def __init__(
        self,
        request: web.Request,
        *,
        idle_timeout_s: float,
        deadline: float | None,
        strip: UsageStrip | None,
        flight: Flight,
        capture: Capture | None,
        on_pause: Callable[[], None] | None = None,
        upstream_chunked: bool = False,
    ) -> None:
        writer = request.writer
        if not isinstance(writer, StreamWriter) or writer.transport is None:
            raise ConnectionResetError("the client's connection is gone")
        self._writer = writer
        self._client = writer.transport
        self._client_proto = writer.protocol
        self._chunked = writer.chunked
        self._loop = asyncio.get_running_loop()
        self._time = self._loop.time
        self._idle = idle_timeout_s
        self._deadline = deadline
        self._strip = strip
        self._flight = flight
        self._capture = capture
        self.tail = StreamTail()
        self._tail = self.tail.feed
        self._reader: StreamReader | None = None
        self._upstream: BaseProtocol | None = None
        self._last = self._time()
        self._last_sent = b"\n\n"
        # Pieces decoded at the clock tick that already wrote one: joined, written once by
        # ``_flush`` (queued with call_soon), so a read holding several events is not a write each.
        self._held: list[bytes] | None = None
        self._paused = False
        self._result: BaseException | None = _PENDING
        self._wake: asyncio.Future[None] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        self.client_gone = False
        self.was_cut = False
        self._on_pause = on_pause  # told each time the client's buffer holds the engine up
        # The raw path (module rules): the engine's chunked framing passed through as it is.
        self._raw_ok = upstream_chunked and self._chunked
        self._tapped: asyncio.Transport | None = None  # the engine connection, while tapped
        self._original: Any = None  # aiohttp's protocol on it
        self._parse: Callable[[bytes], None] | None = None  # that protocol's data_received
        self._raw = False
        self.went_raw = False  # the raw path took over at some point of the stream
        self.chunk_open = True  # the parser's last chunk callback was a begin (or none yet)
        self._chunks = Dechunker()  # the engine's framing, where a read did not end between chunks

    @property
    def at_event_boundary(self) -> bool:
        """Whether what the client got so far ends between two SSE events."""
        return self._last_sent.endswith(b"\n\n")

    def record(self, data: bytes) -> None:
        """Account for engine bytes relayed outside the tap (the first read)."""
        self._flight.relayed += len(data)
        self._tail(data)
        if self._capture is not None:
            self._capture.add(data)

    def sent(self, data: bytes) -> None:
        """Note bytes the relay wrote to the client itself (for the ending's framing)."""
        if data:
            self._last_sent = data

    async def run(self, reader: StreamReader) -> BaseException | None:
        """Relay until the stream ends; the engine failure (or timeout) that ended it, if any."""
        self._take_over(reader)
        try:
            while self._result is _PENDING:
                if self._paused:
                    await self._wait_for_client()
                    continue
                self._wake = self._loop.create_future()
                await self._wake
        finally:
            self._release()
        return self._result

    def cut(self) -> None:
        """End the stream now (drain timeout); the relay tells the client."""
        if self._result is _PENDING:
            self.was_cut = True
            self.end(None)

    def _take_over(self, reader: StreamReader) -> None:
        if reader.exception() is not None:
            self.end(reader.exception())
            return
        if reader.is_eof() or type(reader) is not StreamReader:
            self.end(None)  # the whole body came with the first read (or there is none)
            return
        self._reader = reader
        self._upstream = reader._protocol
        reader.__class__ = TappedReader
        reader._protocol = cast(BaseProtocol, self)
        self._tap()  # the raw path takes over only where ``_raw_ok``
        self._idle_timer = self._loop.call_at(self._time() + self._idle, self._check_idle,
                                              context=_QUIET)
        if self._deadline is not None:
            self._deadline_timer = self._loop.call_at(self._deadline, self._deadline_passed,
                                                      context=_QUIET)

    def _tap(self) -> None:
        """Put the splice between the engine connection and aiohttp's protocol on it: each read
        still goes to the parser, until one ends between two chunks (``_received``)."""
        proto = self._upstream
        self._tapped = tap_connection(proto, self._received, self._lost)
        if self._tapped is not None:
            self._original = proto
            self._parse = proto.data_received  # type: ignore[union-attr]

    def _lost(self) -> None:
        """The engine connection is gone: a body aiohttp did not end (its parser refused the
        framing, and dropped the reader) ends here, as broken."""
        if self._result is _PENDING:
            self.end(ClientPayloadError("the engine's connection closed before the answer ended"))

    def _received(self, data: bytes) -> None:
        """One read of the engine connection, framing included (hot path)."""
        if not self._raw:
            self._observe(data)
            return
        if self._result is not _PENDING:
            return
        if self._chunks.pending:
            self._deframe(data)
            return
        # Whole chunks, each with a non-empty payload, is what an engine writes: they go to
        # the client as they came (the client's framing is the engine's), checked, not rebuilt.
        strip = self._strip
        stripping = strip is not None and not strip.passthrough
        if stripping and (strip.carry or strip.inside  # type: ignore[union-attr]
                          or data.find(strip.MARK) >= 0):  # type: ignore[union-attr]
            self._deframe(data)
            return
        pos, n = 0, len(data)
        more: list[bytes] | None = None  # the chunks before the last, when a read holds several
        while True:
            line = data.find(b"\r\n", pos, pos + MAX_SIZE_LINE)
            head = data[pos:line]
            if line < 0 or not head or head.strip(HEX):
                self._deframe(data)  # a partial or unusual chunk line: read the slow way
                return
            end = line + 2 + int(head, 16)
            if end == line + 2 or data[end:end + 2] != b"\r\n":
                self._deframe(data)  # the last chunk, or a chunk that goes on in the next read
                return
            payload = data[line + 2:end]
            if stripping and not payload.endswith(b"\n\n"):
                # An event across chunks: the strip must see it whole (its usage mark could be
                # split by the framing), so this read goes through it piece by piece.
                self._deframe(data)
                return
            pos = end + 2
            if pos == n:
                break
            if more is None:
                more = [payload]
            else:
                more.append(payload)
        flight, tail, capture = self._flight, self._tail, self._capture
        if more is not None:
            for piece in more:
                flight.relayed += len(piece)
                tail(piece)
                if capture is not None:
                    capture.add(piece)
        flight.relayed += len(payload)
        tail(payload)
        if capture is not None:
            capture.add(payload)
        self._last_sent = payload
        now = self._time()
        if self._held is None and now != self._last:
            self._last = now  # ``_send``'s common case, without its call
            self._write(data)
        else:
            self._send(data, now)

    def _observe(self, data: bytes) -> None:
        """A read before the raw path took over: aiohttp's parser frames it (its pieces come to
        ``feed``); the raw path takes the next read once this one ended between two chunks."""
        parse = self._parse
        assert parse is not None
        parse(data)
        if (self._raw_ok and not self.chunk_open and self._result is _PENDING
                and data.endswith(b"\r\n")):
            # The last callback ended a chunk and nothing of the next one came after its CRLF
            # (a chunk line never ends in CRLF unless complete, and a complete one would have
            # begun a chunk): the parser stands between two chunks.
            self._raw = self.went_raw = True

    def _deframe(self, data: bytes) -> None:
        """Chunked framing read piece by piece (``Dechunker``): each chunk's data goes through
        ``feed``. The last chunk (and any trailers) goes back to aiohttp's parser, which ends the
        message."""
        pieces: list[bytes] = []
        bad = False
        try:
            last = self._chunks.read(data, pieces)
        except FramingError:
            bad, last = True, None
        for piece in pieces:  # what came before any bad framing is relayed first
            self.feed(piece)
        if bad:
            self._bad_framing()
        elif last is not None and self._result is _PENDING:
            self._hand_back(last)

    def _hand_back(self, last: bytes) -> None:
        """The last chunk came: aiohttp's protocol takes the connection back, and its parser,
        which stood between two chunks, reads the rest and ends the body (``end``)."""
        parse = self._parse
        self._untap()
        if parse is not None:
            parse(last)

    def _bad_framing(self) -> None:
        self.end(ClientPayloadError("the engine's chunked framing is malformed"))

    def _untap(self) -> None:
        transport, self._tapped = self._tapped, None
        self._raw = False
        if transport is not None:
            transport.set_protocol(self._original)
        self._original = self._parse = None

    def feed(self, data: bytes) -> None:
        """One piece of body, decoded by the engine connection's parser (hot path)."""
        if self._result is not _PENDING:
            return
        now = self._time()
        self._flight.relayed += len(data)
        self._tail(data)
        if self._capture is not None:
            self._capture.add(data)
        sent = data if self._strip is None else self._strip(data)
        if not sent:
            self._last = now
            return
        self._last_sent = sent
        self._send(b"%x\r\n%b\r\n" % (len(sent), sent) if self._chunked else sent, now)

    def _send(self, framed: bytes, now: float) -> None:
        """Write ``framed`` now, or with what else came at this tick of the loop's clock."""
        if self._held is not None:
            # A write is queued (another piece at this tick: one read held several events): this
            # piece joins it, so the bytes keep their order.
            self._held.append(framed)
        elif now != self._last:
            self._write(framed)
        else:
            self._held = [framed]
            self._loop.call_soon(self._flush, context=_QUIET)
        self._last = now

    def _write(self, framed: bytes) -> None:
        client = self._client
        if client.is_closing():
            self.client_gone = True
            self.end(None)
            return
        client.write(framed)
        # aiohttp's flag behind ``writing_paused``, read without the property's call per write.
        if self._client_proto._paused and not self._paused:
            self._pause()

    def _flush(self) -> None:
        """Write what was held back, as one write (queued once per held batch)."""
        held, self._held = self._held, None
        if held and not self.client_gone:
            self._write(b"".join(held))

    def end(self, failure: BaseException | None) -> None:
        if self._result is not _PENDING:
            return
        self._flush()  # what was relayed goes out before anything the relay writes after it
        if self._result is not _PENDING:
            return  # the flush found the client gone and ended the tap itself
        self._result = failure
        # aiohttp's protocol takes the engine connection back now: after its last chunk to be
        # pooled; before it (client gone, timeout, failure) unfinished, so closed, never reused.
        self._untap()
        self._notify()

    # The StreamReader calls these on its "protocol": they are the engine connection's.
    def pause_reading(self) -> None:
        if self._upstream is not None:
            self._upstream.pause_reading()

    def resume_reading(self, resume_parser: bool = True) -> None:
        if self._upstream is not None:
            self._upstream.resume_reading(resume_parser)

    def _pause(self) -> None:
        self._paused = True
        if self._on_pause is not None:
            self._on_pause()
        if self._upstream is not None:
            self._upstream.pause_reading()
        self._notify()

    async def _wait_for_client(self) -> None:
        """Until the client's buffer drains (or the stream ends meanwhile: cut, deadline)."""
        drained = asyncio.ensure_future(self._writer.drain())
        self._wake = self._loop.create_future()
        lost = False
        try:
            await asyncio.wait((drained, self._wake), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not drained.done():
                drained.cancel()
            elif not drained.cancelled():
                lost = drained.exception() is not None  # retrieved either way: no stray warning
        if self._result is not _PENDING:
            return
        if lost or self._client.is_closing():
            self.client_gone = True
            self.end(None)
            return
        self._paused = False
        self._last = self._time()  # the engine was held up by us, not idle
        if self._result is _PENDING and self._upstream is not None:
            # Decodes what the parser held back; may pause again at once.
            self._upstream.resume_reading()

    def _notify(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _check_idle(self) -> None:
        if self._result is not _PENDING:
            return
        now = self._time()
        due = (now if self._paused else self._last) + self._idle
        if due > now:
            self._idle_timer = self._loop.call_at(due, self._check_idle, context=_QUIET)
            return
        self.end(TimeoutError())

    def _deadline_passed(self) -> None:
        self.end(DeadlinePassed())

    def _release(self) -> None:
        self._untap()  # (``end`` did; the run can also end by cancellation)
        for timer in (self._idle_timer, self._deadline_timer):
            if timer is not None:
                timer.cancel()
        self._idle_timer = self._deadline_timer = None
        self._upstream = None
        if self._reader is not None:
            self._reader._protocol = cast(BaseProtocol, SPENT)
            self._reader = None
