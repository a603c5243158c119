"""Floor references for the overhead benchmark: the least an aiohttp relay can cost here.

Usage: ``python -m bench.floor --port P --engines URL[,URL...] [--splice]``.

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
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import AsyncIterator, Iterator

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
    args = p.parse_args(argv)
    app = build_app([u.rstrip("/") for u in args.engines.split(",")], args.splice)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None,
                loop=uvloop.new_event_loop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
