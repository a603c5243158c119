"""Tenant isolation on a real engine: through the proxy with two tenants' API keys, a long prompt
that tenant A left in the engine's prefix cache is no hit for tenant B (the proxy salts each
tenant's requests with its own ``cache_salt``), and is a hit for A again. The engine's own
``vllm:prefix_cache_hits_total`` is the witness; with ``isolation = "none"`` B does hit, which shows
the test can tell the two apart."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest_asyncio

from contract.client import Backend, metric, wait_until
from proxy.core.cache_key import CacheConfig
from proxy.core.config import Config, ServerConfig
from proxy.core.door_config import AuthConfig, TenantConfig
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.server.lifecycle import ProxyServer

HITS = "vllm:prefix_cache_hits_total"
KEYS = {"tenant-a": "sk-tenant-a-0123456789", "tenant-b": "sk-tenant-b-0123456789"}
AUTH = AuthConfig(
    required=True, tenants=tuple(TenantConfig(name, keys=(key,)) for name, key in KEYS.items())
)
Ask = Callable[[str, str, str], Awaitable[float]]


def proxy_config(backend: Backend, isolation: str) -> Config:
    # One engine, so that both tenants reach the same prefix cache; no response cache, so every
    # request reaches the engine.
    engine = EngineConfig("b", backend.b.url, metrics_url=backend.b.metrics_url)
    pool = PoolConfig("target", backend.model, (engine,), isolation=isolation)
    return Config(server=ServerConfig(host="127.0.0.1", port=0), pools=(pool,), auth=AUTH,
                  cache=CacheConfig(enabled=False))  # fmt: skip


async def settled(url: str) -> float:
    """The engine's prefix-cache hits once two reads a moment apart agree."""
    last = await metric(url, HITS)
    for _ in range(20):
        await asyncio.sleep(0.2)
        now = await metric(url, HITS)
        if now == last:
            return now
        last = now
    return last


@pytest_asyncio.fixture(loop_scope="session")
async def ask(backend: Backend) -> AsyncIterator[Ask]:
    """``await ask(isolation, tenant, prompt)``: the engine's prefix-cache hits that one request
    through a proxy with that ``isolation`` added."""
    servers: dict[str, ProxyServer] = {}
    metrics_url = backend.b.engine_metrics_url or backend.b.metrics_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def server(isolation: str) -> ProxyServer:
            if isolation not in servers:
                servers[isolation] = ProxyServer(proxy_config(backend, isolation))
                await servers[isolation].start()

                async def ready() -> bool:
                    async with http.get(servers[isolation].url + "/ready") as resp:
                        return resp.status == 200

                await wait_until(ready, timeout_s=30, what="proxy ready")
            return servers[isolation]

        async def one(isolation: str, tenant: str, prompt: str) -> float:
            url = (await server(isolation)).url + "/v1/completions"
            before = await settled(metrics_url)
            body = {"model": backend.model, "prompt": prompt, "max_tokens": 1}
            headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            return await settled(metrics_url) - before

        try:
            yield one
        finally:
            for s in servers.values():
                await s.stop()


def long_prompt() -> str:
    # Unique per test run, many KV blocks long (the tiny tokenizer: a few tokens a word).
    return f"{uuid.uuid4().hex} " + " ".join(f"clause {i} of a private contract" for i in range(40))


async def test_tenants_do_not_share_prefix_cache_blocks(ask: Ask) -> None:
    prompt = long_prompt()
    assert await ask("tenant", "tenant-a", prompt) == 0
    assert await ask("tenant", "tenant-b", prompt) == 0
    assert await ask("tenant", "tenant-a", prompt) > 0


async def test_isolation_none_shares_prefix_cache_blocks(ask: Ask) -> None:
    prompt = long_prompt()
    assert await ask("none", "tenant-a", prompt) == 0
    assert await ask("none", "tenant-b", prompt) > 0
