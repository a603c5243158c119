"""The aiohttp-session fetch of ``/metrics`` (for what the kept-connection client does not
speak, https): the same rules as the client's, against a real server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from proxy.fleet.metrics_client import FetchError, fetch_with


async def _serve(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name == "ok":
        return web.Response(text="vllm:num_requests_running 1\n")
    if name == "moved":
        raise web.HTTPFound("/ok")
    if name == "big-announced":
        return web.Response(body=b"x" * 5000)
    out = web.StreamResponse()  # big, chunked: no length announced
    out.enable_chunked_encoding()
    await out.prepare(request)
    for _ in range(10):
        await out.write(b"y" * 1000)
    await out.write_eof()
    return out


@pytest.fixture
async def base() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/{name}", _serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_the_session_fetch_keeps_the_metrics_rules(base: str) -> None:
    async with aiohttp.ClientSession() as session:
        assert await fetch_with(session, base + "/ok", 4096) == b"vllm:num_requests_running 1\n"
        for name, reason in [("moved", "http_302"), ("big-announced", "too_large"),
                             ("big-chunked", "too_large")]:
            with pytest.raises(FetchError) as caught:
                await fetch_with(session, base + "/" + name, 4096)
            assert caught.value.reason == reason, name
