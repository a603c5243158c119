"""Floor references for the overhead benchmark: the least an aiohttp relay can cost here.

Usage: ``python -m bench.floor --port P --engines URL[,URL...] [--splice | --tcp]``.

A measuring instrument, not product code: no limits, no error handling beyond a 502, no
headers filtered. It shows what the framework kvproxy must keep (issue 16: aiohttp is the server
and client for everything) costs by itself, under uvloop as kvproxy runs, so that kvproxy's CPU
per request (a) and per token (b) can be split into the framework's floor and kvproxy's own work.

Rules:
- One POST handler for the OpenAI paths, a keep-alive ``ClientSession`` with no connection limit,
  round-robin over the engines, the engine's status and ``Content-Type`` passed on.
- Default: the body relayed ``iter_any`` -> ``StreamResponse.write`` (aiohttp end to end).
  ``--splice``: the first read the same way, the rest through kvproxy's own ``Splice`` (the
  engine connection's parser callback writes to the client's transport), so the difference
  between the two floors is what the splice saves, without anything else of kvproxy around it.
- ``--tcp``: no HTTP at all. Each client connection gets its own engine connection (engines in
  turn) and the bytes go both ways from one ``asyncio.Protocol`` callback to the other transport's
  ``write``, with flow control. What any relay written in Python on uvloop costs at the least:
  a read, a write and the loop's own turn per event.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from collections.abc import AsyncIterator, Iterator
from typing import cast
from urllib.parse import urlsplit

import aiohttp
import uvloop
from aiohttp import web

from proxy.core.commitment import Flight
from proxy.server.splice import Splice

SESSION = web.AppKey("session", aiohttp.ClientSession)
SPLICE = web.AppKey("splice", bool)
ENGINES: web.AppKey[Iterator[str]] = web.AppKey("engines")


async def _relay(request: web.Request) -> web.StreamResponse:
    engines = request.app[ENGINES]
    engine = next(engines)
    body = await request.read()
    async with request.app[SESSION].post(engine + request.path, data=body,
                                         headers={"Content-Type": "application/json"}) as up:
        out = web.StreamResponse(status=up.status,
                                 headers={"Content-Type": up.headers.get("Content-Type", "")})
        if request.app[SPLICE]:
            first = await up.content.readany()
            await out.prepare(request)
            await out.write(first)
            splice = Splice(request, idle_timeout_s=60.0, deadline=None, strip=None,
                            flight=Flight(0.0, 0.0), capture=None)
            await splice.run(up.content)
        else:
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
        await out.write_eof()
        return out


class _Pipe(asyncio.Protocol):
    """One side of a TCP relay: what it reads goes to ``peer``'s transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.early: list[bytes] = []  # read before the other side connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.early.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


async def start_tcp(host: str, port: int, engines: list[str]) -> asyncio.Server:
    """The ``--tcp`` floor, listening (port 0: any free port)."""
    loop = asyncio.get_running_loop()
    targets = itertools.cycle([urlsplit(u) for u in engines])

    def accepted() -> _Pipe:
        client = _Pipe()
        target = next(targets)

        async def connect() -> None:
            try:
                _, engine = await loop.create_connection(
                    _Pipe, target.hostname, target.port or 80)
            except OSError:
                if client.transport is not None:
                    client.transport.close()
                return
            engine.peer, client.peer = client, engine
            for data in client.early:
                if engine.transport is not None:
                    engine.transport.write(data)
            client.early.clear()

        tasks.add(task := loop.create_task(connect()))
        task.add_done_callback(tasks.discard)
        return client

    tasks: set[asyncio.Task[None]] = set()
    return await loop.create_server(accepted, host, port, reuse_address=True)


async def _tcp(host: str, port: int, engines: list[str]) -> None:
    async with await start_tcp(host, port, engines) as server:
        await server.serve_forever()


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def build_app(engines: list[str], splice: bool) -> web.Application:
    app = web.Application()
    app[ENGINES] = itertools.cycle(engines)
    app[SPLICE] = splice

    async def session(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        app[SESSION] = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/chat/completions", _relay)
    app.router.add_post("/v1/completions", _relay)
    app.router.add_get("/health", _health)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engines", required=True, help="engine base URLs, comma-separated")
    p.add_argument("--splice", action="store_true", help="relay the body through kvproxy's splice")
    p.add_argument("--tcp", action="store_true", help="relay TCP bytes, no HTTP")
    args = p.parse_args(argv)
    engines = [u.rstrip("/") for u in args.engines.split(",")]
    if args.tcp:
        uvloop.run(_tcp(args.host, args.port, engines))
        return 0
    app = build_app(engines, args.splice)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None,
                loop=uvloop.new_event_loop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
