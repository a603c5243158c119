"""Helpers for the HTTP-shell tests: a proxy in front of rogue engines, and raw HTTP/1.1 sockets.

Raw sockets are used where a client library would hide what is tested (a head sent one byte at a
time, a body that never ends, a connection the server closes). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import aiohttp
from integration.stack import proxy_config

from proxy.core.config import ServerConfig
from proxy.server.lifecycle import ProxyServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODEL = "target-model"


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def server_config(**fields: Any) -> ServerConfig:
    base = ServerConfig(host="127.0.0.1", port=0, drain_timeout_s=5.0)
    return dataclasses.replace(base, **fields)


class Engine(Protocol):
    @property
    def url(self) -> str: ...


class RawServer:
    """An engine written byte by byte: an asyncio server on 127.0.0.1 whose ``serve`` answers
    each connection (for what a rogue aiohttp engine cannot send: any head at all)."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


@asynccontextmanager
async def proxy_for(*engines: Engine, **sections: Any) -> AsyncIterator[ProxyServer]:
    """A started proxy whose target pool is ``engines`` (named rogue0, rogue1, ...), once ready."""
    names = [f"rogue{i}" for i in range(len(engines))]
    sections.setdefault("server", server_config())
    cfg = proxy_config([e.url for e in engines], names, ["target"] * len(engines), **sections)
    server = ProxyServer(cfg)
    await server.start()
    try:
        await _wait_ready(server.url)
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def before_proxy(engine: RawServer, **sections: Any) -> AsyncIterator[ProxyServer]:
    """``engine`` started and a proxy before it (``proxy_for``); both stopped on the way out."""
    await engine.start()
    try:
        async with proxy_for(engine, **sections) as server:
            yield server
    finally:
        await engine.stop()


async def _wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as http, asyncio.timeout(5):
        while True:
            async with http.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.02)


@dataclasses.dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


def head(method: str, path: str, **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: kvproxy"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_response(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> RawResponse:
    """One response with a ``Content-Length`` body."""
    async with asyncio.timeout(timeout_s):
        status_line = await reader.readuntil(b"\r\n")
        headers: dict[str, str] = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return RawResponse(int(status_line.split()[1]), headers, body)


async def closed_by_peer(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """True once the server has closed the connection (EOF or reset) within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        async with asyncio.timeout(1):
            await writer.wait_closed()
    except (ConnectionError, TimeoutError):
        pass
