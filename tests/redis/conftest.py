"""Fixtures: a real ``redis-server`` on a free loopback port, stopped by its PID afterwards.

One server is shared by the whole session and flushed before each test that asks for it; tests that
kill or pause Redis get servers of their own from ``redis_factory``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from proxystack import OTHER_MODEL, Stack, proxy_config, sim
from redisproc import SLOW_OK, RedisFactory, RedisServer

from engine_sidecar.sim.cluster import start_cluster
from proxy.core.door_config import DoorConfig, RedisConfig
from proxy.server.app import build_app
from proxy.server.lifecycle import ProxyServer
from proxy.tenancy.redis_link import RedisLink


@pytest.fixture(scope="session")
def _session_redis() -> Iterator[RedisServer]:
    factory = RedisFactory()
    try:
        yield factory.start()
    finally:
        factory.stop_all()


@pytest.fixture
def redis_server(_session_redis: RedisServer) -> RedisServer:
    _session_redis.flush()
    return _session_redis


@pytest.fixture
def redis_factory() -> Iterator[RedisFactory]:
    factory = RedisFactory()
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture
async def link(redis_server: RedisServer) -> AsyncIterator[RedisLink]:
    lk = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    try:
        yield lk
    finally:
        await lk.close()


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    """``await make_stack(door, engines=2, engine_kw={}, cluster=None)``: a proxy before engines."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make(
        door: DoorConfig,
        engines: int = 2,
        engine_kw: dict[str, Any] | None = None,
        cluster: Any = None,
        drafts: int = 0,
    ) -> Stack:
        if cluster is None:
            configs = [sim(f"t{i}", seed=i, **(engine_kw or {})) for i in range(engines)]
            configs += [sim(f"d{i}", OTHER_MODEL, seed=9 + i) for i in range(drafts)]
            cluster = await start_cluster(configs, host="127.0.0.1", port=0)
            cleanups.append(cluster.close)
        names = [e.name for e in cluster.engines]
        cfg = proxy_config(cluster.urls, names, [e.model for e in cluster.engines])
        server = ProxyServer(cfg, build_app(cfg, door=door))
        await server.start()
        cleanups.append(server.stop)
        http = aiohttp.ClientSession()
        cleanups.append(http.close)
        stack = Stack(cluster, server, http)
        await _wait_routable(stack)
        return stack

    yield make
    for cleanup in reversed(cleanups):
        await cleanup()


async def _wait_routable(stack: Stack) -> None:
    async with asyncio.timeout(5):
        while True:
            async with stack.http.get(stack.url + "/ready") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.02)
