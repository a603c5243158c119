"""Fixtures for the loopback integration tests; every server started here is stopped here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from loops import SHIPPED, Factories

from engine_sidecar.sim.cluster import start_cluster
from engine_sidecar.sim.config import SimEngineConfig
from proxy.server.lifecycle import ProxyServer

from .stack import DRAFT_MODEL, TARGET_MODEL, Stack, StackFactory, proxy_config, sim


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    """``await make_stack(targets=2, drafts=0, engine_kw={}, **config_sections)``."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make(
        targets: int = 2, drafts: int = 0, engine_kw: dict[str, Any] | None = None, **sections: Any
    ) -> Stack:
        names = [f"t{i}" for i in range(targets)] + [f"d{i}" for i in range(drafts)]
        pools = ["target"] * targets + ["draft"] * drafts
        configs = [
            _engine(name, pool, i, engine_kw or {})
            for i, (name, pool) in enumerate(zip(names, pools, strict=True))
        ]
        cluster = await start_cluster(configs, host="127.0.0.1", port=0)
        cleanups.append(cluster.close)
        server = ProxyServer(proxy_config(cluster.urls, names, pools, **sections))
        await server.start()
        cleanups.append(server.stop)
        http = aiohttp.ClientSession()
        cleanups.append(http.close)
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=20.0
        )
        cleanups.append(client.close)
        stack = Stack(cluster, server, http, client, names)
        await stack.wait_ready()
        return stack

    yield make
    for cleanup in reversed(cleanups):
        await cleanup()


@pytest.fixture
async def stack(make_stack: StackFactory) -> Stack:
    """Two target engines behind one proxy."""
    return await make_stack()


def _engine(name: str, pool: str, seed: int, kw: dict[str, Any]) -> SimEngineConfig:
    if pool == "draft":
        return sim(DRAFT_MODEL, name, seed=seed, **kw)
    return sim(TARGET_MODEL, name, seed=seed, scheduling_policy="priority", **kw)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Factories:
    """On the loop ``kvproxy serve`` runs on (``tests/loops.py``)."""
    return SHIPPED
