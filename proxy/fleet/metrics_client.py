"""A GET of an engine's ``/metrics`` for a few system calls: one kept-alive connection per
engine, a request written by hand, the reply framed by ``proxy.core.http_reply``.

Why not aiohttp's client: a scrape is the same small request five times a second per engine, and
``ClientSession.get`` spent more of the idle proxy's CPU building and tearing down its per-request
machinery (tracing hooks, cookie jar, header merging, response objects, a stream reader) than the
system calls themselves. This does only what a scrape needs.

Rules:
- Plain ``http://`` URLs only (``supports``); anything else is left to aiohttp by the caller.
- One request at a time per connection; a connection goes back to the pool only after a reply
  read in full that allows keep-alive. Any failure, a timeout or a cancellation (the caller's
  timeout) closes it: a half-read reply would frame the next one wrong.
- No redirects: the reply's status is returned as it is (``FetchError`` ``http_<status>`` for any
  but 200, raised from the head: a body that is not wanted is never read).
- Bounded: the head within ``MAX_HEAD`` bytes, the body within ``max_body`` (``too_large``: the
  connection is closed, the rest never read). The reply is not decompressed (none is asked for).
- Errors are ``FetchError`` with a reason label (``connect``, ``transport``, ``http_<status>``,
  ``too_large``) and a description that names no address.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from proxy.core.http_reply import BadReply, ReplyReader, ReplyTooLarge

MAX_HEAD = 64 * 1024


class FetchError(Exception):
    """A scrape's request that failed; ``reason`` labels the failure metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    request: bytes  # the whole GET, written as it is


def supports(url: str) -> bool:
    """Whether this client can fetch ``url`` (plain HTTP)."""
    return url.startswith("http://")


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    authority = parts.netloc.rpartition("@")[2]
    request = (f"GET {path} HTTP/1.1\r\nHost: {authority}\r\n"
               "Accept: text/plain\r\n\r\n").encode("ascii")  # fmt: skip
    return _Target(host, port, request)


class _Connection(asyncio.Protocol):
    """One connection to one engine; at most one reply awaited on it at a time."""

    def __init__(self, max_body: int) -> None:
        self._max_body = max_body
        self.transport: asyncio.Transport | None = None
        self._reader: ReplyReader | None = None
        self._waiter: asyncio.Future[bytes] | None = None
        self.closed = False
        self.answered = False  # some reply bytes arrived on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport does not derive from asyncio.Transport; it has its methods.
        self.transport = cast(asyncio.Transport, transport)

    def send(self, request: bytes, waiter: asyncio.Future[bytes]) -> None:
        assert self.transport is not None
        self._reader = ReplyReader(max_head=MAX_HEAD, max_body=self._max_body)
        self._waiter = waiter
        self.answered = False
        self.transport.write(request)

    @property
    def reusable(self) -> bool:
        reader = self._reader
        return not self.closed and reader is not None and reader.done and reader.keep_alive

    def data_received(self, data: bytes) -> None:
        reader, waiter = self._reader, self._waiter
        if reader is None or waiter is None or waiter.done():
            self.close()  # bytes nobody asked for: the framing can no longer be trusted
            return
        self.answered = True
        done, error = False, None
        try:
            done = reader.feed(data)
        except ReplyTooLarge:
            error = FetchError("too_large", f"metrics larger than {self._max_body} bytes")
        except BadReply:
            error = FetchError("transport", "metrics reply is not valid HTTP/1.1")
        # The status decides first: a refusal is that, whatever its body would have been.
        if reader.status is not None and reader.status != 200:
            self._fail(_status_error(reader.status))
        elif error is not None:
            self._fail(error)
        elif done:
            waiter.set_result(reader.body)

    def eof_received(self) -> bool | None:
        reader, waiter = self._reader, self._waiter
        if reader is not None and waiter is not None and not waiter.done():
            try:
                reader.feed_eof()
            except BadReply:
                self._fail(FetchError("transport", "metrics connection closed mid-reply"))
                return None
            self._settle(reader)
        self.close()
        return None

    def _settle(self, reader: ReplyReader) -> None:
        assert self._waiter is not None
        if reader.status != 200:
            self._fail(_status_error(reader.status))
        else:
            self._waiter.set_result(reader.body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(FetchError("transport", "metrics connection failed"))

    def _fail(self, error: FetchError) -> None:
        waiter = self._waiter
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _status_error(status: int | None) -> FetchError:
    return FetchError(f"http_{status}", f"metrics answered HTTP {status}")


class MetricsClient:
    """GETs ``/metrics`` URLs over one kept-alive connection per host and port."""

    def __init__(self, max_body: int) -> None:
        self._max_body = max_body
        self._idle: dict[str, _Connection] = {}  # by URL
        self._targets: dict[str, _Target] = {}

    async def get(self, url: str) -> bytes:
        """The body of a 200 reply to ``GET url``; ``FetchError`` otherwise. Cancelling it
        closes the connection."""
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _target(url)
        conn = self._idle.pop(url, None)
        if conn is not None and not conn.closed:
            try:
                return await self._exchange(url, target, conn)
            except FetchError as exc:
                # The server may have closed the kept connection just as we wrote on it: one
                # more try on a fresh one, as any HTTP client does for a safe request.
                if exc.reason != "transport" or conn.answered:
                    raise
        return await self._exchange(url, target, await self._connect(target))

    async def _exchange(self, url: str, target: _Target, conn: _Connection) -> bytes:
        waiter: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        try:
            conn.send(target.request, waiter)
            body = await waiter
        except BaseException:
            conn.close()
            raise
        if conn.reusable:
            self._idle[url] = conn
        else:
            conn.close()
        return body

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                lambda: _Connection(self._max_body), target.host, target.port
            )
        except OSError:
            raise FetchError("connect", "cannot connect to the metrics endpoint") from None
        return conn

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    def forget(self, urls: set[str]) -> None:
        """Close and drop the connections to every URL not in ``urls`` (removed engines)."""
        for url in [u for u in self._idle if u not in urls]:
            self._idle.pop(url).close()
        self._targets = {u: t for u, t in self._targets.items() if u in urls}

    def close(self) -> None:
        for conn in self._idle.values():
            with contextlib.suppress(Exception):
                conn.close()
        self._idle.clear()
