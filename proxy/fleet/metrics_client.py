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
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import aiohttp

from proxy.core.http_reply import BadReply, ReplyReader, ReplyTooLarge
from proxy.fleet.upstream import proxy_short

MAX_HEAD = 64 * 1024


# The failure reason of a scrape this process could not even attempt (no file descriptor left):
# never charged to the engine.
PROXY_SHORT = "proxy_short"


class FetchError(Exception):
    """A scrape that failed, here or in the scraper (``frozen``, ``decode``, aiohttp's https
    path); ``reason`` labels the failure metric."""

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
    """One connection to one engine; at most one reply awaited on it at a time. It hands itself
    back (``release``) after a reply read in full that allows keep-alive; any other end closes
    it. ``on_silent_close``: what to do when the server closes a kept connection before a byte
    of the reply (instead of failing the waiter)."""

    def __init__(self, max_body: int, release: Callable[[_Connection], None],
                 on_silent_close: Callable[[asyncio.Future[bytes]], None]) -> None:
        self._max_body = max_body
        self._release = release
        self._on_silent_close = on_silent_close
        self.transport: asyncio.Transport | None = None
        self._reader: ReplyReader | None = None
        self._waiter: asyncio.Future[bytes] | None = None
        self.closed = False
        self._exchanges = 0
        self._answered = False  # some bytes of the current reply arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport does not derive from asyncio.Transport; it has its methods.
        self.transport = cast(asyncio.Transport, transport)

    def send(self, request: bytes, waiter: asyncio.Future[bytes]) -> None:
        assert self.transport is not None
        self._reader = ReplyReader(max_head=MAX_HEAD, max_body=self._max_body)
        self._waiter = waiter
        self._answered = False
        self._exchanges += 1
        waiter.add_done_callback(self._waiter_done)
        self.transport.write(request)

    def _waiter_done(self, waiter: asyncio.Future[bytes]) -> None:
        if waiter.cancelled() and waiter is self._waiter:
            self.close()  # the caller gave up (its timeout): a half-read reply poisons the rest

    def data_received(self, data: bytes) -> None:
        reader, waiter = self._reader, self._waiter
        if reader is None or waiter is None or waiter.done():
            self.close()  # bytes nobody asked for: the framing can no longer be trusted
            return
        self._answered = True
        done, error = False, None
        try:
            done = reader.feed(data)
        except ReplyTooLarge:
            error = FetchError("too_large", f"metrics larger than {self._max_body} bytes")
        except BadReply:
            error = FetchError("transport", "metrics reply is not valid HTTP/1.1")
        # The status decides first: a refusal is that, whatever its body would have been.
        if reader.status is not None and reader.status != 200:
            self._fail(status_error(reader.status))
        elif error is not None:
            self._fail(error)
        elif done:
            self._waiter = None
            waiter.set_result(reader.body)
            if reader.keep_alive:
                self._release(self)
            else:
                self.close()

    def eof_received(self) -> bool | None:
        reader, waiter = self._reader, self._waiter
        if reader is not None and waiter is not None and not waiter.done():
            try:
                reader.feed_eof()
            except BadReply:
                self._lost_mid_reply()
                return None
            self._waiter = None
            if reader.status != 200:
                waiter.set_exception(status_error(reader.status))
            else:
                waiter.set_result(reader.body)
        self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost_mid_reply()

    def _lost_mid_reply(self) -> None:
        waiter, self._waiter = self._waiter, None
        self.close()
        if waiter is None or waiter.done():
            return
        if self._exchanges > 1 and not self._answered:
            # The server closed the kept connection just as we wrote on it: one more try on
            # a fresh one, as HTTP clients do for a safe request.
            self._on_silent_close(waiter)
        else:
            waiter.set_exception(FetchError("transport", "metrics connection failed"))

    def _fail(self, error: FetchError) -> None:
        waiter, self._waiter = self._waiter, None
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def status_error(status: int | None) -> FetchError:
    """Any reply but 200: a failure named by its status (redirects are never followed)."""
    return FetchError(f"http_{status}", f"metrics answered HTTP {status}")


class MetricsClient:
    """GETs ``/metrics`` URLs over one kept-alive connection per host and port."""

    def __init__(self, max_body: int) -> None:
        self._max_body = max_body
        self._idle: dict[str, _Connection] = {}  # by URL
        self._targets: dict[str, _Target] = {}
        self._resending: set[asyncio.Task[None]] = set()

    async def get(self, url: str) -> bytes:
        """The body of a 200 reply to ``GET url``; ``FetchError`` otherwise. Cancelling it
        closes the connection."""
        return await self.start(url)

    def start(self, url: str) -> asyncio.Future[bytes]:
        """``get`` as a future: when a kept connection is idle, the reply's own future (no
        task, no coroutine: a scrape is this, five times a second per engine)."""
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _target(url)
        conn = self._idle.pop(url, None)
        if conn is None or conn.closed:
            return asyncio.ensure_future(self._fresh(url, target))
        reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        conn.send(target.request, reply)
        return reply

    async def _fresh(self, url: str, target: _Target) -> bytes:
        conn = await self._connect(url, target)
        reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        conn.send(target.request, reply)
        return await reply

    def _resend(self, url: str, target: _Target, reply: asyncio.Future[bytes]) -> None:
        task = asyncio.ensure_future(self._send_fresh(url, target, reply))
        self._resending.add(task)
        task.add_done_callback(self._resending.discard)

    async def _send_fresh(self, url: str, target: _Target, reply: asyncio.Future[bytes]) -> None:
        try:
            conn = await self._connect(url, target)
        except FetchError as exc:
            if not reply.done():
                reply.set_exception(exc)
            return
        if reply.done():  # given up on meanwhile
            conn.close()
            return
        conn.send(target.request, reply)

    async def _connect(self, url: str, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()

        def release(conn: _Connection) -> None:
            old = self._idle.get(url)
            if old is not None and old is not conn:
                old.close()
            self._idle[url] = conn

        def resend(reply: asyncio.Future[bytes]) -> None:
            self._resend(url, target, reply)

        try:
            _, conn = await loop.create_connection(
                lambda: _Connection(self._max_body, release, resend), target.host, target.port
            )
        except OSError as exc:
            if proxy_short(exc):  # this process is out of descriptors: no word on the engine
                raise FetchError(PROXY_SHORT, "the proxy cannot open a connection") from None
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
        for task in self._resending:
            task.cancel()


# --- through an aiohttp session: what ``MetricsClient`` does not speak (https) ---------------

_CHUNK_BYTES = 64 * 1024


async def fetch_with(session: aiohttp.ClientSession, url: str, limit: int) -> bytes:
    """``GET url`` through ``session``, by the same rules: no redirect followed, any status but
    200 a failure, the body read in bounded chunks and refused past ``limit`` bytes."""
    async with session.get(url, allow_redirects=False) as resp:
        if resp.status != 200:
            raise status_error(resp.status)
        return await _read_capped(resp, limit)


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, read in bounded chunks; ``FetchError`` as soon as it exceeds ``limit``."""
    too_large = FetchError("too_large", f"metrics larger than {limit} bytes")
    if resp.content_length is not None and resp.content_length > limit:
        resp.close()
        raise too_large
    body = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK_BYTES):
        body += chunk
        if len(body) > limit:
            # Closing rather than draining: the rest is never read, whatever its size.
            resp.close()
            raise too_large
    return bytes(body)


def transport_failure(exc: aiohttp.ClientError) -> tuple[str, str]:
    """(reason label, description without addresses) of a transport failure."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect", "cannot connect to the metrics endpoint"
    return "transport", "metrics connection failed"
