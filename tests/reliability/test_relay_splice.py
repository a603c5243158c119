"""The spliced relay: engine bytes reach the client exactly, framed right, and a client that does
not read holds the engine up instead of filling the proxy's memory."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import orjson
import pytest

from proxy.server.lifecycle import ProxyServer

from .rogue import RogueEngine
from .shell import CHAT, chat, close, connect, proxy_for


def _event(i: int) -> bytes:
    chunk = {"id": "cmpl-odd", "object": "chat.completion.chunk", "model": "target-model",
             "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


BODY = b"".join(_event(i) for i in range(9)) + b"data: [DONE]\n\n"
# Cut mid-prefix, mid-JSON, between the two newlines, and with several events in one piece.
CUTS = (2, 7, 60, len(_event(0)) - 1, len(_event(0)) + 1, 4 * len(_event(0)) + 3, len(BODY) - 5)
PIECES = [BODY[a:b] for a, b in zip((0, *CUTS), (*CUTS, len(BODY)), strict=True)]


async def _stream_body(url: str, version: str) -> tuple[bytes, dict[str, str]]:
    """The raw body (HTTP/1.1: de-chunked by the client library; HTTP/1.0: up to the close)."""
    body = orjson.dumps(chat(stream=True, stream_options={"include_usage": True}))
    if version == "http11":
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession() as http, asyncio.timeout(10), http.post(
            url + CHAT, data=body, headers=headers
        ) as resp:
            assert resp.status == 200
            return await resp.read(), dict(resp.headers)
    reader, writer = await connect(url)
    writer.write(f"POST {CHAT} HTTP/1.0\r\nHost: kvproxy\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    async with asyncio.timeout(10):
        raw = await reader.read(-1)  # HTTP/1.0 without a length: the body ends with the connection
    await close(writer)
    head, _, got = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].split()[1] == "200"
    return got, dict(line.split(": ", 1) for line in lines[1:])


@pytest.mark.parametrize("sized", [False, True], ids=["chunked", "content_length"])
@pytest.mark.parametrize("version", ["http11", "http10"])
async def test_odd_chunk_boundaries_pass_byte_exact(
    rogue: RogueEngine, sized: bool, version: str
) -> None:
    assert b"".join(PIECES) == BODY and len(PIECES) == len(CUTS) + 1
    rogue.behaviour.stream_pieces = PIECES
    rogue.behaviour.stream_sized = sized
    rogue.behaviour.chunk_delay_s = 0.01  # each piece its own read at the proxy
    async with proxy_for(rogue) as proxy:
        got, headers = await _stream_body(proxy.url, version)
    assert got == BODY
    if version == "http11":
        assert headers.get("Transfer-Encoding") == "chunked"
    else:
        assert "Transfer-Encoding" not in headers


async def test_usage_event_asked_for_the_client_is_stripped_across_odd_chunks(
    rogue: RogueEngine,
) -> None:
    usage = (b'data: {"id":"cmpl-odd","object":"chat.completion.chunk","choices":[],'
             b'"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}\n\n')
    body = BODY.replace(b"data: [DONE]", usage + b"data: [DONE]")
    cut = body.index(b'"usage"')
    rogue.behaviour.stream_pieces = [body[:30], body[30:cut], body[cut:cut + 5], body[cut + 5:]]
    rogue.behaviour.chunk_delay_s = 0.01
    async with proxy_for(rogue) as proxy, aiohttp.ClientSession() as http, http.post(
        proxy.url + CHAT, json=chat(stream=True)
    ) as resp:
        got = await resp.read()
    assert got == BODY  # the client did not ask for usage: the proxy's own request is invisible


def _small_buffer_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    return sock


async def _read_body_after_head(reader: asyncio.StreamReader) -> int:
    """Bytes of the chunked body (framing included) up to its last chunk."""
    received = 0
    async with asyncio.timeout(20):
        while True:
            data = await reader.read(1 << 16)
            received += len(data)
            if not data or data.endswith(b"0\r\n\r\n"):
                return received


async def test_a_client_that_does_not_read_holds_the_engine_up(rogue: RogueEngine) -> None:
    b = rogue.behaviour
    b.tokens, b.token_bytes, b.send_buffer_bytes = 400, 16 * 1024, 16 * 1024  # about 6.5 MB
    total = sum(len(e) for e in rogue._events())
    async with proxy_for(rogue) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        sock = _small_buffer_socket()
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        payload = orjson.dumps(chat(stream=True))
        writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: kvproxy\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        async with asyncio.timeout(5):
            await reader.readuntil(b"\r\n\r\n")  # the head; then the client stops reading
        sent = await _engine_settles(rogue)
        assert sent < total  # the engine is held up: the proxy does not take the whole answer
        # What the proxy itself holds for the client: its transport's buffer, about the
        # high-water mark (64 KiB) plus one read, whatever the size of the answer.
        assert _proxy_buffered(proxy) <= 512 * 1024
        assert await _metric(proxy.url, "kvproxy_relay_pauses_total") >= 1
        received = await _read_body_after_head(reader)  # now read it all: nothing was lost
        await close(writer)
    assert rogue.stream_bytes_sent == [total]
    assert received > total


def _proxy_buffered(proxy: ProxyServer) -> int:
    server = proxy._runner.server  # the test looks inside: no public view of transport buffers
    assert server is not None
    return sum(h.transport.get_write_buffer_size() for h in server.connections if h.transport)


async def _engine_settles(rogue: RogueEngine) -> int:
    """The engine's bytes sent once it stops making progress (bounded wait)."""
    last = -1
    async with asyncio.timeout(10):
        while True:
            await asyncio.sleep(0.3)
            sent = rogue.stream_bytes_sent[-1] if rogue.stream_bytes_sent else 0
            if sent == last and sent > 0:
                return sent
            last = sent


async def _metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("sized", [False, True], ids=["chunked", "content_length"])
@pytest.mark.parametrize("version", ["http11", "http10"])
def test_events_read_together_are_written_together_byte_exact(
    sized: bool, version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under uvloop (the production loop; its clock ticks in milliseconds), an engine read holding
    several events is written to the client in one go: same bytes, same framing, nothing lost at
    the end of the stream."""
    import uvloop  # noqa: PLC0415 - only this test runs its own loop

    from proxy.server import splice  # noqa: PLC0415

    flushes: list[int] = []
    real_flush = splice.Splice._flush

    def counting_flush(self: splice.Splice) -> None:
        flushes.append(len(self._held or ()))
        real_flush(self)

    monkeypatch.setattr(splice.Splice, "_flush", counting_flush)

    async def scenario() -> bytes:
        engine = RogueEngine()
        await engine.start()
        try:
            engine.behaviour.stream_pieces = PIECES
            engine.behaviour.stream_sized = sized
            # The first piece alone (the proxy's first read), the rest in one burst after it.
            engine.behaviour.chunk_delay_s = 0.05
            engine.behaviour.burst_after = 2
            async with proxy_for(engine) as proxy:
                got, _ = await _stream_body(proxy.url, version)
        finally:
            await engine.stop()
        return got

    assert uvloop.run(scenario()) == BODY
    # A chunked engine body gives one piece per HTTP chunk: the burst's were joined into one
    # write. A sized body gives one piece per read: nothing to join.
    assert any(held > 1 for held in flushes) is not sized


async def test_an_http10_stream_closes_its_connection_even_when_asked_to_keep_it(
    rogue: RogueEngine,
) -> None:
    # HTTP/1.0 has no chunked framing: a stream's end is the connection's close. Asked to keep
    # the connection alive, the proxy must still close it at the stream's end, or the client
    # waits for the keep-alive timeout to see its answer end.
    rogue.behaviour.stream_pieces = PIECES
    async with proxy_for(rogue) as proxy:
        body = orjson.dumps(chat(stream=True))
        reader, writer = await connect(proxy.url)
        writer.write(f"POST {CHAT} HTTP/1.0\r\nHost: kvproxy\r\nConnection: keep-alive\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        async with asyncio.timeout(5):
            raw = await reader.read(-1)
        await close(writer)
    head, _, got = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split()[1] == b"200"
    assert got.endswith(b"data: [DONE]\n\n")
