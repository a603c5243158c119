"""Bytes an engine sends past the end of its answer never answer another request: a pooled
connection holding a response nobody asked for is closed when it is next taken from the pool.

The engine is a raw keep-alive server, so every byte is the test's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from integration.stack import TARGET_MODEL, chat_body

from proxy.core.config import UpstreamConfig

from .rogue import HEALTHY_METRICS
from .shell import RawServer, before_proxy

STRAY = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 23\r\n\r\n"
         b'{"smuggled":"INJECTED"}')


def _answer(text: str) -> bytes:
    return (b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,'
            b'"finish_reason":"stop","message":{"role":"assistant","content":"%s"}}]}'
            % text.encode())


def _sse(text: str) -> bytes:
    event = (b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
             b'"delta":{"content":"%s"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
             % text.encode())
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event)


class KeepAliveEngine(RawServer):
    """Answers each request on a kept-alive connection; a prompt holding ``stray`` gets its
    answer with a whole extra response in the same write (``late``: written 0.3 s later, to
    the connection idle in the pool)."""

    def __init__(self, idle_close_s: float | None = None) -> None:
        super().__init__()
        self.asked: list[str] = []
        self.data_connections = 0  # connections that carried a completion request
        self.idle_close_s = idle_close_s  # close a connection idle this long, as vLLM does (5 s)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        posted = False
        try:
            while True:
                async with asyncio.timeout(self.idle_close_s):
                    head = await reader.readuntil(b"\r\n\r\n")
                length, rid = 0, ""
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                    if name.lower() == b"x-request-id":
                        rid = value.strip().decode()
                body = await reader.readexactly(length)
                if head.startswith(b"GET /metrics"):
                    text = HEALTHY_METRICS.encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(text), text))
                    continue
                if not head.startswith(b"POST"):
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                self.asked.append(rid)
                if not posted:
                    posted = True
                    self.data_connections += 1
                stream = b'"stream": true' in body or b'"stream":true' in body
                if stream:
                    out = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n" + _sse(f"answer-for-{rid}"))
                else:  # chunked too: its last chunk can share a read with what follows
                    answer = _answer(f"answer-for-{rid}")
                    out = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                           % (len(answer), answer))
                if b"stray-late" in body:
                    writer.write(out)
                    await writer.drain()
                    await asyncio.sleep(0.3)
                    writer.write(STRAY)
                elif b"stray" in body:
                    # The answer up to its last chunk, then that chunk and a whole extra
                    # response in one write (one read at the proxy).
                    writer.write(out[:-5])
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    writer.write(out[-5:] + STRAY)
                else:
                    writer.write(out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[KeepAliveEngine, str]]:
    engine = KeepAliveEngine()
    async with before_proxy(engine) as server:
        yield engine, server.url


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stray", ["stray", "stray-late"])
async def test_an_engines_stray_response_never_answers_the_next_request(
    proxied: tuple[KeepAliveEngine, str], stream: bool, stray: str
) -> None:
    engine, url = proxied
    async with aiohttp.ClientSession() as http:

        async def ask(prompt: str, rid: str, *, streamed: bool) -> tuple[int, bytes]:
            body = chat_body(prompt, model=TARGET_MODEL, stream=streamed)
            async with http.post(url + "/v1/chat/completions", json=body,
                                 headers={"X-Request-Id": rid}) as r:
                return r.status, await r.read()

        status, first = await ask(stray, "first", streamed=stream)
        assert status == 200 and b"answer-for-first" in first
        await asyncio.sleep(0.6)  # a late stray response lands while the connection is pooled
        for rid in ("client-a", "client-b"):
            status, body = await ask("hello", rid, streamed=False)
            assert (status, b"INJECTED" in body) == (200, False), body
            assert f"answer-for-{rid}".encode() in body
    assert engine.asked == ["first", "client-a", "client-b"]


async def test_no_connection_is_reused_past_the_pools_keep_alive() -> None:
    # The engine closes a connection idle 0.5 s; the proxy keeps idle ones 0.3 s. Requests 0.4 s
    # apart each get a new connection, so none is sent on one the engine is just closing.
    engine = KeepAliveEngine(idle_close_s=0.5)
    upstream = UpstreamConfig(connect_timeout_s=1.0, first_byte_timeout_s=5.0, keepalive_s=0.3)
    async with before_proxy(engine, upstream=upstream) as server, aiohttp.ClientSession() as http:
        for i in range(5):
            body = chat_body("hello", model=TARGET_MODEL)
            async with http.post(server.url + "/v1/chat/completions", json=body,
                                 headers={"X-Request-Id": f"r{i}"}) as r:
                assert r.status == 200, await r.read()
            await asyncio.sleep(0.4)
    assert engine.data_connections == 5 and engine.asked == [f"r{i}" for i in range(5)]
