"""A cap on client connections (``server.max_connections``): past it, a proxied request is
answered 503 and its connection closed, the proxy's probes still answer, and the connections
within the cap are served as before.

Idle client connections are raw sockets over loopback; the refused request is the SDK's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

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

CAP = 3


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@contextlib.asynccontextmanager
async def _held(url: str, count: int) -> AsyncIterator[None]:
    """``count`` open client connections that send nothing."""
    opened = [await connect(url) for _ in range(count)]
    try:
        yield
    finally:
        for _, writer in opened:
            await close(writer)


async def _metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exposed")


async def test_a_request_past_the_cap_is_refused_and_its_connection_closed(
    rogue: RogueEngine,
) -> None:
    async with proxy_for(rogue, server=server_config(max_connections=CAP)) as proxy:
        async with _held(proxy.url, CAP):
            client = _client(proxy.url)
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(**chat())
            await client.close()
            response = caught.value.response
            assert response.status_code == 503
            assert response.headers["x-kvproxy-shed-reason"] == "connections"
            assert response.headers["retry-after"] == "1"
            assert response.headers["connection"] == "close"
            error = response.json()["error"]
            assert error["type"] == "overloaded"
            assert f"limit of {CAP} client connections" in error["message"]
        # The held connections are closed: the next request is served.
        client = _client(proxy.url)
        answer = await client.chat.completions.create(**chat())
        await client.close()
        assert answer.choices[0].message.content
        assert await _metric(proxy.url, "kvproxy_client_connections_refused_total") == 1
        assert await _metric(proxy.url, "kvproxy_client_connections_limit") == CAP
    assert len(rogue.requests_to(CHAT)) == 1  # the refused request never reached an engine


async def test_probes_are_answered_past_the_cap_then_the_connection_closes(
    rogue: RogueEngine,
) -> None:
    async with (
        proxy_for(rogue, server=server_config(max_connections=CAP)) as proxy,
        _held(proxy.url, CAP),
    ):
        for path in ("/health", "/ready", "/metrics"):
            reader, writer = await connect(proxy.url)
            writer.write(head("GET", path))
            answer = await read_response(reader)
            assert answer.status == 200, path
            assert answer.headers["connection"] == "close"
            assert await closed_by_peer(reader, timeout_s=5.0)
            await close(writer)


async def test_connections_within_the_cap_keep_being_served(rogue: RogueEngine) -> None:
    async with (
        proxy_for(rogue, server=server_config(max_connections=CAP)) as proxy,
        _held(proxy.url, CAP - 1),
    ):
        client = _client(proxy.url)  # one kept-alive connection: the cap's last place
        for _ in range(3):
            answer = await client.chat.completions.create(**chat())
            assert answer.choices[0].message.content
        await client.close()
        # Once the client's connection is closed, /metrics gets the place.
        assert await _metric(proxy.url, "kvproxy_client_connections_refused_total") == 0


async def test_open_connections_are_counted_and_the_count_falls_as_they_close(
    rogue: RogueEngine,
) -> None:
    async with proxy_for(rogue, server=server_config(max_connections=100)) as proxy:
        # Each scrape of /metrics is a connection of its own, counted as it is answered.
        alone = await _metric(proxy.url, "kvproxy_client_connections")
        async with _held(proxy.url, 5):
            assert await _metric(proxy.url, "kvproxy_client_connections") == alone + 5
        for _ in range(50):
            if await _metric(proxy.url, "kvproxy_client_connections") == alone:
                break
            await asyncio.sleep(0.02)
        assert await _metric(proxy.url, "kvproxy_client_connections") == alone
