"""A cap on client connections (``server.max_connections``): past it, a grace of a few
connections each get one request answered (a proxied request refused 503, the probes answered)
and are closed; past the grace, connections are closed as soon as they are accepted; the
connections within the cap are served as before.

Idle client connections are raw sockets over loopback; the refused requests are the SDK's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from proxy.core.conncap import grace

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
GRACE = grace(CAP)


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


async def _exposition(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        return await resp.text()


async def _metric(url: str, name: str) -> float:
    for line in (await _exposition(url)).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exposed")


async def test_a_request_past_the_cap_is_refused_counted_and_its_connection_closed(
    rogue: RogueEngine,
) -> None:
    async with proxy_for(rogue, server=server_config(max_connections=CAP)) as proxy:
        async with _held(proxy.url, CAP):
            client = _client(proxy.url)
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(
                    **chat(), extra_headers={"X-Request-Id": "past-the-cap-1"}
                )
            await client.close()
            response = caught.value.response
            assert response.status_code == 503
            assert response.headers["x-kvproxy-shed-reason"] == "connections"
            assert response.headers["retry-after"] == "1"
            assert response.headers["connection"] == "close"
            assert response.headers["x-request-id"] == "past-the-cap-1"
            assert response.headers["x-cache"] == "BYPASS"
            error = response.json()["error"]
            assert error["type"] == "overloaded"
            assert f"limit of {CAP} client connections" in error["message"]
        # The held connections are closed: the next request is served.
        client = _client(proxy.url)
        answer = await client.chat.completions.create(**chat())
        await client.close()
        assert answer.choices[0].message.content
        text = await _exposition(proxy.url)
        assert "kvproxy_client_connections_refused_total 1.0" in text
        assert f"kvproxy_client_connections_limit {float(CAP)}" in text
        # Counted as every proxied request is: a shed, with its status.
        assert 'kvproxy_shed_total{class="standard",pool="none",reason="connections"} 1.0' in text
        assert 'pool="none",status="503"} 1.0' in text
    assert len(rogue.requests_to(CHAT)) == 1  # the refused request never reached an engine


async def test_other_requests_past_the_cap_are_answered_then_the_connection_closes(
    rogue: RogueEngine,
) -> None:
    async with (
        proxy_for(rogue, server=server_config(max_connections=CAP)) as proxy,
        _held(proxy.url, CAP),
    ):
        for path in ("/health", "/ready", "/metrics", "/v1/models"):
            reader, writer = await connect(proxy.url)
            writer.write(head("GET", path))
            answer = await read_response(reader)
            assert answer.status == 200, path
            assert answer.headers["connection"] == "close"
            assert await closed_by_peer(reader, timeout_s=5.0)
            await close(writer)
        # Malformed HTTP is a 400, as within the cap, not a 503 that invites a retry.
        reader, writer = await connect(proxy.url)
        writer.write(b"GARBAGE\r\n\r\n")
        assert (await read_response(reader)).status == 400
        await close(writer)


async def test_past_the_cap_and_its_grace_connections_are_closed_at_once(
    rogue: RogueEngine,
) -> None:
    # The head deadline stays at its default (10 s): what closes these is the cap, not it.
    async with proxy_for(rogue, server=server_config(max_connections=CAP)) as proxy:
        async with _held(proxy.url, CAP):
            grace_held = [await connect(proxy.url) for _ in range(GRACE)]
            reader, writer = await connect(proxy.url)  # past the cap and the grace
            # Half the head deadline: closed by the cap (dropped: counted below).
            assert await closed_by_peer(reader, timeout_s=5.0)
            await close(writer)
            # Those of the grace that send nothing give their place back after 1 s, long before
            # the head deadline.
            for grace_reader, _ in grace_held:
                assert await closed_by_peer(grace_reader, timeout_s=8.0)
            for _, grace_writer in grace_held:
                await close(grace_writer)
        assert await _metric(proxy.url, "kvproxy_client_connections_dropped_total") == 1
        # A client within the cap, after all of this, is served.
        client = _client(proxy.url)
        answer = await client.chat.completions.create(**chat())
        await client.close()
        assert answer.choices[0].message.content


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
        # Once the client's connection is closed, /metrics gets the place (or the grace's).
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
