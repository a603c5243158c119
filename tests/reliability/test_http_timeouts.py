"""Slow and oversized clients: request heads and bodies have deadlines, refused bodies are not read,
and a drain that times out ends open streams with an error event.

Raw sockets over loopback; the configured limits are small so every test stays short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import orjson
import pytest

from proxy.observe.throttle import Throttle
from proxy.server import connections

from .rogue import RogueEngine
from .shell import (
    CHAT,
    chat,
    close,
    closed_by_peer,
    connect,
    head,
    proxy_for,
    read_response,
    server_config,
)

HEAD_LIMIT_S = 0.5


async def _trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    for i in range(len(data)):
        writer.write(data[i : i + 1])
        await writer.drain()
        await asyncio.sleep(every_s)


async def test_a_head_sent_one_byte_at_a_time_is_cut_off(rogue: RogueEngine) -> None:
    async with proxy_for(rogue, server=server_config(header_timeout_s=HEAD_LIMIT_S)) as proxy:
        reader, writer = await connect(proxy.url)
        endless = head("POST", CHAT) * 1000  # far longer than the deadline lets through
        trickler = asyncio.create_task(_trickle(writer, endless, 0.05))
        try:
            assert await closed_by_peer(reader, timeout_s=5.0)
        finally:
            trickler.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await trickler
            await close(writer)
    assert rogue.requests_to(CHAT) == []


async def test_a_connection_that_never_sends_a_head_is_closed(rogue: RogueEngine) -> None:
    async with proxy_for(rogue, server=server_config(header_timeout_s=HEAD_LIMIT_S)) as proxy:
        reader, writer = await connect(proxy.url)
        assert await closed_by_peer(reader, timeout_s=5.0)
        await close(writer)


async def test_many_connections_that_never_send_a_head_write_one_log_line(
    rogue: RogueEngine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.server.connections")
    # A throttle of its own: another test's line this minute would hold this test's back.
    monkeypatch.setattr(connections, "_SLOW_HEADS", Throttle(60.0))
    async with proxy_for(rogue, server=server_config(header_timeout_s=HEAD_LIMIT_S)) as proxy:
        opened = [await connect(proxy.url) for _ in range(20)]
        for reader, writer in opened:
            assert await closed_by_peer(reader, timeout_s=5.0)
            await close(writer)
    lines = [r.getMessage() for r in caplog.records if "did not arrive" in r.getMessage()]
    assert len(lines) == 1  # counted, one line a minute at most; not a line per connection


async def test_kept_alive_connection_serves_requests_and_times_its_next_head(
    rogue: RogueEngine,
) -> None:
    body = orjson.dumps(chat())
    request = head("POST", CHAT, Content_Type="application/json", Content_Length=str(len(body)))
    async with proxy_for(rogue, server=server_config(header_timeout_s=HEAD_LIMIT_S)) as proxy:
        reader, writer = await connect(proxy.url)
        # An idle pause longer than the head deadline, between requests, is the keep-alive's.
        for _ in range(2):
            writer.write(request + body)
            assert (await read_response(reader)).status == 200
            await asyncio.sleep(HEAD_LIMIT_S * 1.5)
        # The next head trickles: cut once the deadline from its first byte has passed.
        trickler = asyncio.create_task(_trickle(writer, request * 100, 0.05))
        try:
            assert await closed_by_peer(reader, timeout_s=5.0)
        finally:
            trickler.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await trickler
            await close(writer)
    assert len(rogue.requests_to(CHAT)) == 2


async def test_a_body_sent_too_slowly_gets_408_and_the_connection_closes(
    rogue: RogueEngine,
) -> None:
    body = orjson.dumps(chat("x" * 200))
    request = head("POST", CHAT, Content_Type="application/json", Content_Length=str(len(body)))
    async with proxy_for(rogue, server=server_config(body_timeout_s=0.5)) as proxy:
        reader, writer = await connect(proxy.url)
        writer.write(request)
        trickler = asyncio.create_task(_trickle(writer, body, 0.05))
        try:
            resp = await read_response(reader)
            assert await closed_by_peer(reader, timeout_s=5.0)
        finally:
            trickler.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await trickler
            await close(writer)
    assert resp.status == 408
    assert resp.headers["connection"] == "close"
    error = orjson.loads(resp.body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "request_timeout"
    assert rogue.requests_to(CHAT) == []


async def test_413_closes_the_connection_without_reading_the_rest(rogue: RogueEngine) -> None:
    declared = 100 * 1024 * 1024
    request = head("POST", CHAT, Content_Type="application/json", Content_Length=str(declared))
    sent = 0

    async def send_body(writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        chunk = b"x" * 65536
        while sent < declared:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)

    async with proxy_for(rogue, server=server_config(max_body_bytes=4096)) as proxy:
        reader, writer = await connect(proxy.url)
        writer.write(request)
        sender = asyncio.create_task(send_body(writer))
        try:
            resp = await read_response(reader)
            assert await closed_by_peer(reader, timeout_s=5.0)
            # Once closed, the client can no longer push the rest of its body.
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(5):
                    await sender
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await sender
            await close(writer)
    assert resp.status == 413
    assert resp.headers["connection"] == "close"
    assert orjson.loads(resp.body)["error"]["code"] == "payload_too_large"
    # What went out before the close fits in socket buffers; reading on would take all 100 MiB.
    assert sent < declared // 2


async def test_a_stream_open_past_the_drain_timeout_ends_with_an_error_event(
    rogue: RogueEngine,
) -> None:
    rogue.behaviour.tokens = 10_000
    rogue.behaviour.chunk_delay_s = 0.02
    async with (
        proxy_for(rogue, server=server_config(drain_timeout_s=0.3)) as proxy,
        aiohttp.ClientSession() as http,
        http.post(proxy.url + CHAT, json=chat(stream=True)) as resp,
    ):
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        stopping = asyncio.create_task(proxy.drain_and_stop())
        async with asyncio.timeout(10):
            rest = await resp.content.read()  # no transport error: the stream ends
        finished = await stopping
    assert finished is False
    events = [e for e in rest.split(b"\n\n") if e.strip()]
    last = events[-1]
    assert last.startswith(b"data: ")
    error = orjson.loads(last.removeprefix(b"data: "))["error"]
    assert "shutting down" in error["message"]
    assert b"[DONE]" not in rest
    async with asyncio.timeout(5):
        # The engine's connection was closed, so it stops generating.
        while rogue.streams_cut == 0:  # noqa: ASYNC110 (the rogue engine counts, no event)
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_unanswered_at_the_drain_timeout_gets_a_503(
    rogue: RogueEngine, stream: bool
) -> None:
    # The engine has not begun the answer when the drain runs out: the client gets a 503 it may
    # retry elsewhere, not a connection closed with nothing on it.
    rogue.behaviour.completions = "hang"
    async with (
        proxy_for(rogue, server=server_config(drain_timeout_s=0.3)) as proxy,
        aiohttp.ClientSession() as http,
    ):
        asking = asyncio.create_task(http.post(proxy.url + CHAT, json=chat(stream=stream)))
        async with asyncio.timeout(5):
            while not rogue.requests_to(CHAT):  # noqa: ASYNC110 (the rogue records, no event)
                await asyncio.sleep(0.02)
        finished = await proxy.drain_and_stop()
        async with asyncio.timeout(5):
            resp = await asking
            body = await resp.read()
    assert finished is False
    assert resp.status == 503 and resp.headers["X-Kvproxy-Shed-Reason"] == "draining"
    assert "Retry-After" in resp.headers
    assert "shutting down" in orjson.loads(body)["error"]["message"]
