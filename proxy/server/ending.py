"""How a relayed stream ends: its outcome, its last writes, and the recorder's one look at it.

Rules:
- Once per stream, never per event: the ending goes through the response object after the tap
  (``splice.Splice``) has stopped writing.
- A stream the engine broke off, stalled, or ran past the client's deadline ends with one SSE
  error event instead of ``[DONE]``; a cut in the middle of an event first ends that event, so the
  error is not glued onto a partial line.
- The recorder sees what was kept of the stream once, at its end, or is told it was too big.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from proxy.core.errors import KvproxyError, UpstreamError, UpstreamTimeout
from proxy.core.recording import Recorder
from proxy.core.usage import StreamTail, UsageStrip
from proxy.server.splice import Capture, DeadlinePassed


@dataclass
class StreamEnd:
    """How a relayed stream ended."""

    client_gone: bool = False
    was_cut: bool = False
    failure: BaseException | None = None
    tail: StreamTail = field(default_factory=StreamTail)


def tell_recorder(recorder: Recorder, capture: Capture) -> None:
    """Hand the recorder what was kept of the stream, once, at its end."""
    if capture.overflowed:
        recorder.skipped(capture.size)
    else:
        recorder.feed(b"".join(capture.chunks))


def cut_event(exc: BaseException) -> KvproxyError:
    """The error event that ends a stream the engine broke off, stalled, or ran past a deadline."""
    if isinstance(exc, DeadlinePassed):
        return UpstreamTimeout("the request's deadline passed; the answer is incomplete")
    if isinstance(exc, TimeoutError):
        stalled = "the engine's stream stalled between chunks; the answer is incomplete"
        return UpstreamTimeout(stalled)
    return UpstreamError("the engine's stream broke off; the answer is incomplete")


class Ending:
    """The last writes of a stream, through the response object: once per stream, not per event.
    Each returns False when the client turned out to be gone."""

    def __init__(self, out: web.StreamResponse, strip: UsageStrip | None) -> None:
        self._out = out
        self._strip = strip

    async def send(self, data: bytes) -> bool:
        try:
            await self._out.write(data)
        except ConnectionResetError:
            return False
        return True

    async def error(self, event: KvproxyError, at_boundary: bool) -> bool:
        if self._strip is not None:
            self._strip.flush()  # a held-back partial event: incomplete, never sent
        # A cut mid-event would glue our event onto a partial line; end that event first.
        lead = b"" if at_boundary else b"\n\n"
        if not await self.send(lead + b"data: " + event.body() + b"\n\n"):
            return False
        return await self._eof()

    async def finish(self) -> bool:
        rest = b"" if self._strip is None else self._strip.flush()
        if rest and not await self.send(rest):
            return False
        return await self._eof()

    async def _eof(self) -> bool:
        try:
            await self._out.write_eof()
        except ConnectionResetError:
            return False
        return True
