"""Faults of real processes: an engine killed mid-stream, Redis paused under load.

These pin behaviours that hold today so that later rewrites of the relay keep them: a stream cut by
a dead engine ends with one SSE error event (never a silent truncation, never ``[DONE]``), the
requests after it go to the surviving engine without a client error, and a Redis server that stops
answering costs no client an error.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from integration.stack import TARGET_MODEL, chat_body, proxy_config
from prometheus_client.parser import text_string_to_metric_families

from proxy.server.app import build_app
from proxy.server.lifecycle import ProxyServer

from .conftest import RedisFactory, door_config
from .procs import EngineProcess, start_engine


@pytest.fixture
async def engines() -> AsyncIterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    try:
        for i in range(2):
            # Slow enough that a 400-token answer is still streaming when the engine is killed.
            started.append(
                await start_engine(f"p{i}", TARGET_MODEL, "--time-scale", "20", "--seed", str(i))
            )
        yield started
    finally:
        for engine in started:
            await engine.stop()


def _total(text: str, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


async def _ready(http: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(10):
        while True:
            async with http.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.05)


async def test_engine_killed_mid_stream_ends_with_an_error_event(
    engines: list[EngineProcess],
) -> None:
    cfg = proxy_config([e.url for e in engines], ["p0", "p1"], ["target", "target"])
    server = ProxyServer(cfg)
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            await _ready(http, server.url)
            body = chat_body("a long answer", max_tokens=400, ignore_eos=True, stream=True)
            async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                victim = engines[["p0", "p1"].index(resp.headers["X-Engine"])]
                await resp.content.readuntil(b"\n\n")  # the stream is flowing
                os.kill(victim.proc.pid, signal.SIGKILL)
                raw = await asyncio.wait_for(resp.read(), 15)
            events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
            assert events, "the client got nothing after the kill"
            assert events[-1] != b"data: [DONE]"
            last = orjson.loads(events[-1].removeprefix(b"data: "))
            assert "error" in last and "incomplete" in last["error"]["message"]

            # What comes next is served by the survivor; at most the first retry sees the corpse.
            statuses = []
            for i in range(6):
                async with http.post(
                    server.url + "/v1/chat/completions", json=chat_body(f"after {i}")
                ) as r:
                    await r.read()
                    statuses.append((r.status, r.headers.get("X-Engine")))
            assert all(status == 200 for status, _ in statuses), statuses
            survivor = "p1" if victim is engines[0] else "p0"
            assert {engine for _, engine in statuses} == {survivor}
    finally:
        await server.stop()


async def test_redis_paused_under_load_costs_no_client_errors(
    engines: list[EngineProcess], redis_factory: RedisFactory
) -> None:
    server_redis = redis_factory.start()
    door = door_config(
        redis_url=server_redis.url,
        backend="redis",
        limits={"enabled": True, "requests_per_min": 100_000, "concurrent_streams": 1000},
        redis={"op_timeout_s": 0.2, "retry_after_failure_s": 0.3},
    )
    cfg = proxy_config([e.url for e in engines], ["p0", "p1"], ["target", "target"])
    server = ProxyServer(cfg, build_app(cfg, door=door))
    await server.start()
    statuses: list[int] = []
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as http:
            await _ready(http, server.url)

            async def client(n: int) -> None:
                i = 0
                while not stop.is_set():
                    i += 1
                    body = chat_body(f"client {n} question {i % 3}", temperature=0, max_tokens=4)
                    key = ("sk-acme-0000000001", "sk-beta-0000000002")[n % 2]
                    async with http.post(
                        server.url + "/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {key}"},
                    ) as resp:
                        await resp.read()
                        statuses.append(resp.status)

            async def felt(since: int) -> bool:
                """More than five answers since ``since``, and a Redis call has failed."""
                async with http.get(server.url + "/metrics") as resp:
                    errors = _total(await resp.text(), "kvproxy_redis_errors_total")
                return len(statuses) > since + 5 and errors >= 1

            clients = [asyncio.create_task(client(n)) for n in range(6)]
            try:
                async with asyncio.timeout(20):
                    while len(statuses) <= 5:  # noqa: ASYNC110 - polls the clients' answers
                        await asyncio.sleep(0.05)
                before = len(statuses)
                os.kill(server_redis.pid, signal.SIGSTOP)  # Redis hangs: no answer, no reset
                try:
                    # The pause is felt (Redis calls time out) and absorbed: answers go on.
                    async with asyncio.timeout(20):
                        while not await felt(before):  # noqa: ASYNC110
                            await asyncio.sleep(0.05)
                finally:
                    os.kill(server_redis.pid, signal.SIGCONT)
                during = len(statuses)
                async with asyncio.timeout(20):  # and go on once Redis is back
                    while len(statuses) <= during + 5:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
            finally:
                stop.set()
                await asyncio.gather(*clients)
        assert set(statuses) == {200}
    finally:
        await server.stop()
