"""The loopback test stack: simulated engines and a proxy in this event loop, on 127.0.0.1:0.

A ``Stack`` is one proxy in front of a ``SimCluster``. Engines run at a high time scale so that a
request takes milliseconds; tests that need a request to stay open ask for a slower scale or a
stall fault.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from engine_sidecar.sim.cluster import SimCluster
from engine_sidecar.sim.config import SimEngineConfig
from proxy.core.config import BreakerConfig, Config, ServerConfig, TelemetryConfig, UpstreamConfig
from proxy.core.fleet_config import AliasConfig, EngineConfig, PoolConfig
from proxy.server.lifecycle import ProxyServer

TARGET_MODEL = "target-model"
DRAFT_MODEL = "draft-model"
ALIAS = "chat"
FAST = 200.0  # simulated engines run this many times faster than the modelled hardware


@dataclass
class Stack:
    """One proxy in front of a simulated cluster, plus clients for both."""

    cluster: SimCluster
    server: ProxyServer
    http: aiohttp.ClientSession
    client: openai.AsyncOpenAI
    names: list[str]  # engine names, in cluster order

    @property
    def url(self) -> str:
        return self.server.url

    def engine_url(self, name: str) -> str:
        return self.cluster.urls[self.names.index(name)]

    async def faults(self, name: str, **faults: Any) -> None:
        async with self.http.post(self.engine_url(name) + "/admin/faults", json=faults) as resp:
            assert resp.status == 200, await resp.text()

    async def clear_faults(self, name: str) -> None:
        async with self.http.delete(self.engine_url(name) + "/admin/faults") as resp:
            assert resp.status == 200

    async def engine_state(self, name: str) -> dict[str, Any]:
        async with self.http.get(self.engine_url(name) + "/admin/state") as resp:
            result: dict[str, Any] = await resp.json()
            return result

    async def admin(self) -> dict[str, dict[str, Any]]:
        async with self.http.get(self.url + "/admin/engines") as resp:
            body = await resp.json()
        return {row["name"]: row for row in body["engines"]}

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of the proxy's samples called ``name`` whose labels include ``labels``."""
        async with self.http.get(self.url + "/metrics") as resp:
            text = await resp.text()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total

    async def post(self, path: str, body: object, **headers: str) -> aiohttp.ClientResponse:
        resp = await self.http.post(self.url + path, json=body, headers=headers)
        await resp.read()
        return resp

    async def wait_for(
        self, check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0, what: str = ""
    ) -> None:
        async with asyncio.timeout(timeout_s):
            while not await check():  # noqa: ASYNC110 (polls the proxy over HTTP)
                await asyncio.sleep(0.02)

    async def wait_health(self, name: str, health: str, timeout_s: float = 5.0) -> None:
        async def check() -> bool:
            return bool((await self.admin())[name]["health"] == health)

        await self.wait_for(check, timeout_s)

    async def wait_idle(self) -> None:
        """Until the proxy's view of every engine shows no load."""

        async def check() -> bool:
            return all(row["load"] == 0 for row in (await self.admin()).values())

        await self.wait_for(check)

    async def wait_ready(self) -> None:
        async def check() -> bool:
            rows = await self.admin()
            return all(row["health"] == "healthy" for row in rows.values())

        await self.wait_for(check)


StackFactory = Callable[..., Awaitable["Stack"]]


def sim(model: str, name: str, **kw: Any) -> SimEngineConfig:
    kw.setdefault("time_scale", FAST)
    kw.setdefault("stop_len_range", (8, 16))
    return SimEngineConfig(model=model, name=name, profile="llama8b-h100", **kw)


def proxy_config(
    urls: Sequence[str], names: Sequence[str], pools: Sequence[str], **sections: Any
) -> Config:
    members: dict[str, list[EngineConfig]] = {}
    for url, name, pool in zip(urls, names, pools, strict=True):
        members.setdefault(pool, []).append(EngineConfig(name, url))
    models = {"target": TARGET_MODEL, "draft": DRAFT_MODEL}
    pool_cfgs = tuple(
        PoolConfig(pool, models[pool], tuple(engines), priority_scheduling=pool == "target")
        for pool, engines in members.items()
    )
    aliases = (AliasConfig(ALIAS, "target", tiering="draft" in members),)
    base = Config(
        server=ServerConfig(host="127.0.0.1", port=0, drain_timeout_s=5.0),
        telemetry=TelemetryConfig(interval_s=0.1, timeout_s=0.09, stale_after_s=0.6),
        upstream=UpstreamConfig(
            connect_timeout_s=1.0, first_byte_timeout_s=5.0, idle_timeout_s=5.0
        ),
        breaker=BreakerConfig(failure_threshold=2, open_s=0.5),
        pools=pool_cfgs,
        aliases=aliases,
    )
    return dataclasses.replace(base, **sections)


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": TARGET_MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
    }
    body.update(extra)
    return body
