"""An engine's response head, byte for byte (a raw server): what of it reaches the client.

Only allow-listed headers pass, every value of a repeated one, none the engine named in its
``Connection`` header, none whose value carries a control character (the client's writer would
refuse it and break the answer), and a transfer coding the proxy never asked for is a failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from integration.stack import TARGET_MODEL, chat_body

from .rogue import HEALTHY_METRICS
from .shell import RawServer, before_proxy

ANSWER = (b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,'
          b'"finish_reason":"stop","message":{"role":"assistant","content":"hi"}}]}')


class RawEngine(RawServer):
    """Answers every POST with ``head`` (status line and headers, CRLF-joined) and ``ANSWER``,
    chunked where ``head`` names a transfer coding, else with its length."""

    def __init__(self) -> None:
        super().__init__()
        self.head = b""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            if head.startswith(b"GET /metrics"):
                body = HEALTHY_METRICS.encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                             b"%d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            elif head.startswith(b"POST") and b"Transfer-Encoding" in self.head:
                writer.write(self.head + b"\r\nConnection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                             % (len(ANSWER), ANSWER))
            elif head.startswith(b"POST"):
                writer.write(self.head + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                             % (len(ANSWER), ANSWER))
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()


@pytest.fixture
async def raw() -> AsyncIterator[tuple[RawEngine, str]]:
    engine = RawEngine()
    async with before_proxy(engine) as server:
        yield engine, server.url


async def _ask(url: str) -> tuple[int, list[tuple[str, str]], bytes]:
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/chat/completions",
                         json=chat_body("hi", model=TARGET_MODEL)) as r:
        return r.status, list(r.headers.items()), await r.read()


async def test_repeated_headers_keep_every_value(raw: tuple[RawEngine, str]) -> None:
    engine, url = raw
    engine.head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                   b"Cache-Control: no-store\r\nCache-Control: private\r\n"
                   b"x-ratelimit-remaining-requests: 5\r\nx-ratelimit-remaining-requests: 6")
    status, headers, body = await _ask(url)
    assert status == 200 and body == ANSWER
    assert [v for k, v in headers if k == "Cache-Control"] == ["no-store", "private"]
    assert [v for k, v in headers if k.lower() == "x-ratelimit-remaining-requests"] == ["5", "6"]


async def test_headers_the_engine_names_in_connection_stay_behind(
    raw: tuple[RawEngine, str],
) -> None:
    engine, url = raw
    engine.head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                   b"Connection: openai-internal, X-RateLimit-Limit\r\n"
                   b"openai-internal: secret\r\nX-RateLimit-Limit: 9\r\nopenai-version: 1")
    status, headers, _ = await _ask(url)
    names = {k.lower() for k, _ in headers}
    assert status == 200 and "openai-version" in names
    assert not names & {"openai-internal", "x-ratelimit-limit"}


@pytest.mark.parametrize("byte", [1, 8, 0x0B, 0x1F, 0x7F])
async def test_a_control_character_in_a_header_drops_that_header_only(
    raw: tuple[RawEngine, str], byte: int
) -> None:
    engine, url = raw
    engine.head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                   b"openai-processing-ms: 1" + bytes([byte]) + b"2\r\nopenai-version: 1")
    status, headers, body = await _ask(url)
    names = {k.lower() for k, _ in headers}
    assert (status, body) == (200, ANSWER)
    assert "openai-version" in names and "openai-processing-ms" not in names


async def test_a_transfer_coding_never_asked_for_is_a_failure(raw: tuple[RawEngine, str]) -> None:
    engine, url = raw
    engine.head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: gzip, chunked")
    status, _, body = await _ask(url)
    assert status == 502, body
    engine.head = engine.head.replace(b"gzip, ", b"")  # the control: plain chunked passes
    assert (await _ask(url))[0] == 200
