"""A proxy with its front door (tenants, limits, cache, Redis) before simulated engines.

Also ``python tests/redis/proxystack.py CONFIG.json``: one proxy process (for the tests that need
several replicas as separate processes); it prints its URL on the first line of stdout and serves
until SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families
from redisproc import SLOW_OK

from engine_sidecar.sim.cluster import SimCluster
from engine_sidecar.sim.config import SimEngineConfig
from proxy.core.cache_key import CacheConfig
from proxy.core.config import BreakerConfig, Config, ServerConfig, TelemetryConfig, UpstreamConfig
from proxy.core.door_config import AuthConfig, DoorConfig, LimitsConfig, RedisConfig, TenantConfig
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.server.app import build_app
from proxy.server.lifecycle import ProxyServer

MODEL = "target-model"
OTHER_MODEL = "draft-model"
SECRET = "test-secret-0123456789"
KEYS = {"acme": "sk-acme-0000000001", "beta": "sk-beta-0000000002", "gamma": "sk-gamma-00000003"}


def sim(name: str, model: str = MODEL, **kw: Any) -> SimEngineConfig:
    kw.setdefault("time_scale", 200.0)
    kw.setdefault("stop_len_range", (8, 16))
    return SimEngineConfig(model=model, name=name, profile="llama8b-h100", **kw)


def proxy_config(urls: Sequence[str], names: Sequence[str], models: Sequence[str]) -> Config:
    pools: dict[str, list[EngineConfig]] = {}
    for url, name, model in zip(urls, names, models, strict=True):
        pools.setdefault(model, []).append(EngineConfig(name, url))
    pool_names = {MODEL: "target", OTHER_MODEL: "draft"}
    return Config(
        server=ServerConfig(host="127.0.0.1", port=0, drain_timeout_s=2.0),
        telemetry=TelemetryConfig(interval_s=0.1, timeout_s=0.09, stale_after_s=0.6),
        upstream=UpstreamConfig(
            connect_timeout_s=1.0, first_byte_timeout_s=5.0, idle_timeout_s=5.0
        ),
        breaker=BreakerConfig(failure_threshold=2, open_s=3.0),
        pools=tuple(PoolConfig(pool_names[m], m, tuple(e)) for m, e in pools.items()),
    )


def door_config(
    *,
    redis_url: str = "",
    backend: str = "memory",
    required: bool = True,
    limits: dict[str, Any] | None = None,
    redis: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
) -> DoorConfig:
    tenants = tuple(TenantConfig(name, keys=(key,)) for name, key in KEYS.items())
    return DoorConfig(
        auth=AuthConfig(required=required, tenants=tenants),
        cache=CacheConfig(backend=backend, secret=SECRET, **(cache or {})),
        redis=RedisConfig(url=redis_url, **{**SLOW_OK, **(redis or {})}),
        limits=LimitsConfig(**(limits or {})),
    )


@dataclass
class Stack:
    cluster: SimCluster
    server: ProxyServer
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, tenant: str = "acme") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=20.0
        )

    async def post(
        self, body: dict[str, Any], tenant: str | None = "acme", **headers: str
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        if tenant is not None:
            headers["Authorization"] = f"Bearer {KEYS[tenant]}"
        async with self.http.post(
            self.url + "/v1/chat/completions", json=body, headers=headers
        ) as r:
            return r, await r.read()

    async def faults(self, **faults: Any) -> None:
        for url in self.cluster.urls:
            async with self.http.post(url + "/admin/faults", json=faults) as resp:
                assert resp.status == 200, await resp.text()

    async def clear_faults(self) -> None:
        for url in self.cluster.urls:
            async with self.http.delete(url + "/admin/faults") as resp:
                assert resp.status == 200

    async def metric(self, name: str, **labels: str) -> float:
        return await scrape(self.http, self.url + "/metrics", name, **labels)

    async def engine_requests(self) -> float:
        total = 0.0
        for url in self.cluster.urls:
            total += await scrape(self.http, url + "/metrics", "vllm:request_success_total")
        return total


async def scrape(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with http.get(url) as resp:
        text = await resp.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def chat(content: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    return {**body, "temperature": 0, **extra}


# --- one proxy process --------------------------------------------------------------------------


async def _serve(spec: dict[str, Any]) -> None:
    cfg = proxy_config(spec["urls"], spec["names"], spec["models"])
    door = door_config(**spec["door"])
    server = ProxyServer(cfg, build_app(cfg, door=door))
    await server.start()
    print(server.url, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        asyncio.run(_serve(json.load(fh)))
