"""What an engine's answer can be made of, and what the client gets for each: statuses that are
no answer, encodings nobody asked for, answers too large to hold, framing that is not HTTP, and
heads that are not HTTP. Each is an engine failure, told to the client at once, never a hang.

Real servers on loopback: the proxy in front of rogue engines.
"""

from __future__ import annotations

import asyncio
import errno
import time
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.core.config import BreakerConfig, OutlierConfig, UpstreamConfig
from proxy.observe.throttle import Throttle
from proxy.server import relay
from proxy.server.keys import SHELL

from .rogue import RogueEngine
from .shell import CHAT, chat, proxy_for

# Long enough that waiting for one would fail the test's own time bound.
SLOW = UpstreamConfig(first_byte_timeout_s=30.0, response_timeout_s=30.0, idle_timeout_s=30.0,
                      retries=0)


async def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes, float]:
    started = time.monotonic()
    async with aiohttp.ClientSession() as http, asyncio.timeout(20), http.post(
        url + CHAT, json=body
    ) as resp:
        raw = await resp.read()
        return resp.status, raw, time.monotonic() - started


async def _errors(url: str, kind: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvproxy_upstream_errors_total{") and f'kind="{kind}"' in line)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_switching_protocols_is_a_502_and_a_failure(
    rogue: RogueEngine, stream: bool
) -> None:
    rogue.behaviour.completions = "status"
    rogue.behaviour.completion_status = 101
    rogue.behaviour.completion_headers = {"Upgrade": "websocket", "Connection": "Upgrade"}
    async with proxy_for(rogue, upstream=SLOW) as proxy:
        status, raw, took = await _post(proxy.url, chat(stream=stream))
        assert status == 502 and took < 5
        assert "HTTP 101" in orjson.loads(raw)["error"]["message"]
        assert await _errors(proxy.url, "http_101") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_in_an_encoding_never_asked_for_is_a_502(
    rogue: RogueEngine, stream: bool
) -> None:
    # The proxy never asks for an encoding (nor passes one on): bytes the client could not read.
    rogue.behaviour.completion_headers = {"Content-Encoding": "gzip"}
    async with proxy_for(rogue, upstream=SLOW) as proxy:
        status, raw, _ = await _post(proxy.url, chat(stream=stream))
    assert status == 502
    assert "encoding it was not asked for" in orjson.loads(raw)["error"]["message"]


async def test_a_plain_answer_over_the_limit_is_refused_by_its_length_or_as_it_comes(
    rogue: RogueEngine,
) -> None:
    limit = UpstreamConfig(max_response_bytes=2048, retries=0)
    rogue.behaviour.tokens = 4096  # a JSON answer of over 4 KB, with its Content-Length
    lenient = {"breaker": BreakerConfig(failure_threshold=10),
               "outlier": OutlierConfig(enabled=False)}
    async with proxy_for(rogue, upstream=limit, **lenient) as proxy:
        status, raw, _ = await _post(proxy.url, chat())
        assert status == 502
        assert "max_response_bytes" in orjson.loads(raw)["error"]["message"]
        # Chunked, no length announced: refused once past the limit as it arrives.
        piece = b"400\r\n" + b"x" * 1024 + b"\r\n"
        rogue.behaviour.raw_plain = [piece] * 4 + [b"0\r\n\r\n"]
        status, raw, _ = await _post(proxy.url, chat())
        assert status == 502
        assert "max_response_bytes" in orjson.loads(raw)["error"]["message"]
        rogue.behaviour.tokens, rogue.behaviour.raw_plain = 8, []
        status, _, _ = await _post(proxy.url, chat())  # a small one still passes
        assert status == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_broken_framing_ends_the_answer_at_once_not_at_a_timeout(
    rogue: RogueEngine, stream: bool
) -> None:
    # One good chunk, then a chunk line that is not hex, then the engine closes its connection.
    # aiohttp's parser refuses it and drops the body: without the proxy's watch the request
    # would wait for its timeout (30 s here), and be counted as a slow engine, not a broken one.
    good = b"data: {}\n\n" if stream else b'{"id":'
    pieces = [f"{len(good):x}\r\n".encode() + good + b"\r\n", b"zz\r\nnot a chunk\r\n"]
    rogue.behaviour.chunk_delay_s = 0.05  # each piece its own read at the proxy
    if stream:
        rogue.behaviour.raw_chunked = pieces
    else:
        rogue.behaviour.raw_plain = pieces
    async with proxy_for(rogue, upstream=SLOW) as proxy:
        status, raw, took = await _post(proxy.url, chat(stream=stream))
    assert took < 5, took
    if stream and status == 200:  # the good chunk went out: the stream ends with an error event
        assert b'"error"' in raw and not raw.endswith(b"data: [DONE]\n\n")
    else:
        assert status == 502


async def test_a_head_that_is_not_http_is_retried_on_another_engine(
    rogue: RogueEngine,
) -> None:
    other = RogueEngine()
    await other.start()
    rogue.behaviour.completions = "garbage"
    try:
        async with proxy_for(rogue, other, upstream=UpstreamConfig(retries=1)) as proxy:
            answered = 0
            for _ in range(4):  # whichever engine ranks first, the garbage one is passed over
                status, _, _ = await _post(proxy.url, chat())
                answered += status == 200
            assert answered == 4
            assert await _errors(proxy.url, "malformed_head") >= 1
    finally:
        await other.stop()


async def test_a_proxy_out_of_file_descriptors_blames_no_engine(
    rogue: RogueEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Client connections held the last descriptors: the engine is not at fault, no other engine
    would do better, and the client is told to come back (before: a 502, then a breaker open
    on a healthy engine, then 503 'no engine reachable' for everyone)."""

    async def no_descriptor(req: Any, *args: Any, **kwargs: Any) -> Any:
        raise aiohttp.ClientConnectorError(req.connection_key,
                                           OSError(errno.EMFILE, "Too many open files"))

    async with proxy_for(rogue) as proxy:
        # A throttle of its own: another test's line this minute would hold this test's back.
        monkeypatch.setattr(relay, "_SHORT_WARN", Throttle(60.0))
        # The proxy's own data-path connections only (the test's client is not short of any).
        connector = proxy.app[SHELL].session.connector
        monkeypatch.setattr(connector, "_create_direct_connection", no_descriptor)
        for _ in range(6):
            status, raw, _ = await _post(proxy.url, chat())
            assert status == 503
            assert orjson.loads(raw)["error"]["type"] == "overloaded"
        monkeypatch.undo()
        async with aiohttp.ClientSession() as http, http.get(proxy.url + "/metrics") as resp:
            text = await resp.text()
        assert "kvproxy_proxy_short_total 6.0" in text
        assert await _errors(proxy.url, "connect") == 0
        status, _, _ = await _post(proxy.url, chat())  # the engine was never shut out
        assert status == 200
    warned = [r for r in caplog.records if "cannot open connections" in r.getMessage()]
    assert len(warned) == 1  # one line a minute at most, not one per request
