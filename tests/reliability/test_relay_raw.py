"""The relay's raw path: once aiohttp's parser stands between two chunks of a chunked engine body,
the engine's reads go to the client as they came, framing included, and the last chunk goes back
to the parser. Whatever the cuts of the engine's bytes, the client gets exactly the body, the
usage event the proxy asked for stays invisible, bad framing ends the stream with an error
event, and the engine connection is pooled again only after a complete body."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from proxy.server import splice as splice_module

from .rogue import RogueEngine
from .shell import CHAT, chat, proxy_for
from .test_relay_splice import _metric


def _event(i: int) -> bytes:
    chunk = {"id": "cmpl-raw", "object": "chat.completion.chunk", "model": "target-model",
             "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


USAGE = (b'data: {"id":"cmpl-raw","object":"chat.completion.chunk","choices":[],'
         b'"usage":{"prompt_tokens":3,"completion_tokens":6,"total_tokens":9}}\n\n')
DONE = b"data: [DONE]\n\n"
EVENTS = [_event(i) for i in range(6)]


def frame(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


# Each event its own chunk (as engines write), two events in one chunk, then the usage event and
# [DONE], and the last chunk.
TAIL = (frame(EVENTS[2]) + frame(EVENTS[3] + EVENTS[4]) + frame(EVENTS[5]) + frame(USAGE)
        + frame(DONE) + b"0\r\n\r\n")
CLEAN = b"".join(EVENTS) + DONE  # what a client that did not ask for usage gets


def _pieces(cut: int) -> list[bytes]:
    # The first read (the relay's own), a read that ends between two chunks (the raw path takes
    # over after it), then the rest cut once at ``cut``.
    return [frame(EVENTS[0]), frame(EVENTS[1]), TAIL[:cut], TAIL[cut:]]


async def _body(url: str, **extra: object) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http, asyncio.timeout(10), http.post(
        url + CHAT, json=chat(stream=True, **extra)
    ) as resp:
        return resp.status, await resp.read()


@pytest.fixture
def raw_reads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each engine read the splice got: whether the raw path had taken over."""
    seen: list[bool] = []
    real = splice_module.Splice._received

    def counting(self: splice_module.Splice, data: bytes) -> None:
        seen.append(self._raw)
        real(self, data)

    monkeypatch.setattr(splice_module.Splice, "_received", counting)
    return seen


async def test_every_cut_of_the_engine_bytes_reaches_the_client_byte_exact(
    rogue: RogueEngine, raw_reads: list[bool]
) -> None:
    rogue.behaviour.chunk_delay_s = 0.005  # each piece its own read at the proxy
    cuts = [c for c in range(1, len(TAIL)) if c % 5 == 0 or TAIL[c - 1:c + 1] in
            (b"\r\n", b"\n0", b"\n\r")]  # every fifth byte, and around each line end
    async with proxy_for(rogue) as proxy:
        for cut in cuts:
            rogue.behaviour.raw_chunked = _pieces(cut)
            status, got = await _body(proxy.url)
            assert (status, got) == (200, CLEAN), cut
            # The client asked for usage: the same bytes, the usage event included.
            status, got = await _body(proxy.url, stream_options={"include_usage": True})
            assert (status, got) == (200, b"".join(EVENTS) + USAGE + DONE), cut
    assert any(raw_reads), "the raw path never took over"


async def test_a_stream_of_whole_chunks_goes_the_raw_way_and_its_connection_is_reused(
    rogue: RogueEngine, raw_reads: list[bool]
) -> None:
    rogue.behaviour.chunk_delay_s = 0.005
    rogue.behaviour.raw_chunked = [frame(e) for e in EVENTS] + [frame(DONE), b"0\r\n\r\n"]
    async with proxy_for(rogue) as proxy:
        for _ in range(3):
            raw_reads.clear()
            assert await _body(proxy.url) == (200, CLEAN)
            # First read the relay's, the second through the parser; every later one raw.
            assert raw_reads[:1] == [False] and all(raw_reads[1:-1] or [False])
        assert await _metric(proxy.url, "kvproxy_relay_raw_streams_total") == 3
    # Each complete body gave its connection back to the pool: one connection carried all three.
    assert len(rogue.raw_peers) == 3 and len(set(rogue.raw_peers)) == 1


async def test_bad_framing_after_the_raw_path_took_over_ends_with_an_error_event(
    rogue: RogueEngine, raw_reads: list[bool]
) -> None:
    rogue.behaviour.chunk_delay_s = 0.005
    rogue.behaviour.raw_chunked = [frame(EVENTS[0]), frame(EVENTS[1]), frame(EVENTS[2]),
                                   b"zz\r\n" + EVENTS[3] + b"\r\n", frame(DONE) + b"0\r\n\r\n"]
    async with proxy_for(rogue) as proxy:
        status, got = await _body(proxy.url)
        assert status == 200
        assert got.startswith(EVENTS[0] + EVENTS[1] + EVENTS[2])
        assert b"broke off" in got and b"[DONE]" not in got
        assert any(raw_reads)
        # The connection that carried bad framing is closed, not reused: the next answer is whole.
        rogue.behaviour.raw_chunked = [frame(e) for e in EVENTS] + [frame(DONE), b"0\r\n\r\n"]
        assert await _body(proxy.url) == (200, CLEAN)
    assert len(rogue.raw_peers) == 2 and rogue.raw_peers[0] != rogue.raw_peers[1]


async def test_a_chunk_line_that_never_ends_is_refused_not_buffered(
    rogue: RogueEngine, raw_reads: list[bool]
) -> None:
    rogue.behaviour.chunk_delay_s = 0.005
    rogue.behaviour.raw_chunked = [frame(EVENTS[0]), frame(EVENTS[1]), b"1" * 4096,
                                   b"\r\n" + b"x" * 16]
    async with proxy_for(rogue) as proxy:
        status, got = await _body(proxy.url)
    assert status == 200 and b"broke off" in got and b"[DONE]" not in got


@pytest.mark.parametrize("bad", [
    pytest.param(b"%x\n" % len(EVENTS[3]) + EVENTS[3][:40], id="bare LF after the size"),
    pytest.param(b"%x\r\n%b\n" % (len(EVENTS[3]), EVENTS[3]) + b"%x\n" % len(EVENTS[4]),
                 id="bare LF after a chunk's data"),
])
async def test_a_chunk_line_ended_by_a_bare_lf_is_refused_at_once(
    rogue: RogueEngine, raw_reads: list[bool], bad: bytes
) -> None:
    # The engine then stays silent (its connection open) for longer than the test waits: the
    # framing error is seen in the read that carried it, not at the idle timeout.
    rogue.behaviour.chunk_delay_s = 0.005
    rogue.behaviour.raw_hold_s = 30.0
    rogue.behaviour.raw_chunked = [frame(EVENTS[0]), frame(EVENTS[1]), frame(EVENTS[2]), bad]
    async with proxy_for(rogue) as proxy, asyncio.timeout(5):
        status, got = await _body(proxy.url)
    assert status == 200 and got.startswith(EVENTS[0] + EVENTS[1] + EVENTS[2])
    assert b"broke off" in got and b"[DONE]" not in got
    assert any(raw_reads)


async def test_a_chunk_size_with_leading_zeros_is_read_as_its_value(
    rogue: RogueEngine, raw_reads: list[bool]
) -> None:
    # 20 digits for a small value, and an extension (so the slow path reads the line).
    padded = b"%020x;x=1\r\n%b\r\n" % (len(EVENTS[3]), EVENTS[3])
    rogue.behaviour.chunk_delay_s = 0.005
    rogue.behaviour.raw_chunked = ([frame(e) for e in EVENTS[:3]] + [padded]
                                   + [frame(e) for e in EVENTS[4:]] + [frame(DONE), b"0\r\n\r\n"])
    async with proxy_for(rogue) as proxy:
        assert await _body(proxy.url) == (200, CLEAN)
    assert any(raw_reads)


async def test_an_engine_that_dies_mid_body_ends_the_stream_with_an_error_event(
    rogue: RogueEngine, raw_reads: list[bool]
) -> None:
    rogue.behaviour.chunk_delay_s = 0.005
    rogue.behaviour.raw_chunked = [frame(e) for e in EVENTS[:4]]  # then the connection closes
    async with proxy_for(rogue) as proxy:
        async with asyncio.timeout(5):  # well inside the idle timeout: the close is seen at once
            status, got = await _body(proxy.url)
        assert status == 200 and got.startswith(b"".join(EVENTS[:4]))
        assert b"broke off" in got and b"[DONE]" not in got
        assert any(raw_reads)
        rogue.behaviour.raw_chunked = [frame(e) for e in EVENTS] + [frame(DONE), b"0\r\n\r\n"]
        assert await _body(proxy.url) == (200, CLEAN)  # and the next answer is whole
