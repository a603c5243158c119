"""Fixtures of the simulator tests: live engines on 127.0.0.1 port 0 and a client session.

Engines run at a high time scale so a test takes milliseconds of wall time per simulated second;
no test asserts on wall-clock speed beyond generous bounds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from engine_sidecar.sim.cluster import SimCluster, start_cluster
from engine_sidecar.sim.config import SimEngineConfig

FAST = 200.0
Start = Callable[..., Awaitable[SimCluster]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    clusters: list[SimCluster] = []

    async def _start(*configs: SimEngineConfig, **defaults: Any) -> SimCluster:
        if not configs:
            defaults.setdefault("time_scale", FAST)
            configs = (SimEngineConfig(**defaults),)
        cluster = await start_cluster(list(configs), host="127.0.0.1", port=0)
        clusters.append(cluster)
        return cluster

    yield _start
    for cluster in clusters:
        await cluster.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def parse_sse(raw: bytes) -> list[Any]:
    """Events of an SSE body: decoded JSON objects, and the string ``"[DONE]"``."""
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append("[DONE]" if data == "[DONE]" else orjson.loads(data))
    return events


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


async def metric(http: aiohttp.ClientSession, url: str, name: str, labels: str = "") -> float:
    """Value of the first sample ``name{...labels...}`` in ``/metrics`` (0 if absent)."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
