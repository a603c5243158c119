"""Tenant isolation inside the engines: with ``isolation = "tenant"`` one tenant's prompt never
reuses the KV blocks another tenant's identical prompt left in the engine's prefix cache, whatever
``cache_salt`` the client sends; with ``isolation = "none"`` the cache is shared as before. The
engine's own ``vllm:prefix_cache_hits_total`` is the witness."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_sidecar.sim.cluster import start_cluster
from proxy.core.door_config import AuthConfig, TenantConfig
from proxy.server.keys import SHELL
from proxy.server.lifecycle import ProxyServer

from .stack import TARGET_MODEL, proxy_config, sim

KEYS = {"acme": "sk-acme-0123456789", "beta": "sk-beta-0123456789"}
HITS = "vllm:prefix_cache_hits_total"
AUTH = AuthConfig(
    required=True, tenants=tuple(TenantConfig(name, keys=(key,)) for name, key in KEYS.items())
)


@dataclasses.dataclass
class Iso:
    server: ProxyServer
    engine_url: str
    http: aiohttp.ClientSession

    async def hits(self) -> float:
        async with self.http.get(self.engine_url + "/metrics") as resp:
            text = await resp.text()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == HITS)  # fmt: skip

    async def ask(self, tenant: str, prompt: str, **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"model": TARGET_MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": prompt}], **extra}  # fmt: skip
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        async with self.http.post(self.server.url + "/v1/chat/completions", json=body,
                                  headers=headers) as resp:  # fmt: skip
            return resp.status, await resp.json()

    async def hit_delta(self, tenant: str, prompt: str, **extra: Any) -> float:
        before = await self.hits()
        status, body = await self.ask(tenant, prompt, **extra)
        assert status == 200, body
        return await self.hits() - before


Factory = Callable[..., Awaitable[Iso]]


@pytest.fixture
async def make_iso() -> AsyncIterator[Factory]:
    """One simulated engine behind a proxy with two tenants; ``isolation`` and ``auth`` settable."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make(isolation: str = "tenant", auth: AuthConfig = AUTH) -> Iso:
        cluster = await start_cluster([sim(TARGET_MODEL, "t0")], host="127.0.0.1", port=0)
        cleanups.append(cluster.close)
        cfg = proxy_config(cluster.urls, ["t0"], ["target"], auth=auth)
        pools = tuple(dataclasses.replace(p, isolation=isolation) for p in cfg.pools)
        server = ProxyServer(dataclasses.replace(cfg, pools=pools))
        await server.start()
        cleanups.append(server.stop)
        http = aiohttp.ClientSession()
        cleanups.append(http.close)
        return Iso(server, cluster.urls[0], http)

    yield make
    for cleanup in reversed(cleanups):
        await cleanup()


def long_prompt() -> str:
    # Fresh for every test: many full KV blocks that no earlier request left in the cache.
    nonce = uuid.uuid4().hex
    return f"{nonce} " + " ".join(f"clause {i} of the confidential contract" for i in range(40))


async def test_tenants_share_no_engine_blocks(make_iso: Factory) -> None:
    iso = await make_iso()
    prompt = long_prompt()
    assert await iso.hit_delta("acme", prompt) == 0
    assert await iso.hit_delta("beta", prompt) == 0
    # The same tenant again does reuse its own blocks: the salt is stable per tenant.
    assert await iso.hit_delta("acme", prompt) > 0
    assert await iso.hit_delta("beta", prompt) > 0


async def test_isolation_none_shares_the_engine_cache(make_iso: Factory) -> None:
    iso = await make_iso(isolation="none")
    prompt = long_prompt()
    assert await iso.hit_delta("acme", prompt) == 0
    assert await iso.hit_delta("beta", prompt) > 0


async def test_a_client_salt_cannot_reach_another_tenants_blocks(make_iso: Factory) -> None:
    iso = await make_iso()
    prompt = long_prompt()
    assert await iso.hit_delta("acme", prompt) == 0
    # Even the exact salt the engine saw for acme, sent by beta, is keyed again under beta.
    acme_salt = iso.server.app[SHELL].salts.salt("acme", None)
    assert await iso.hit_delta("beta", prompt, cache_salt=acme_salt) == 0
    assert await iso.hit_delta("beta", prompt, cache_salt="acme") == 0


async def test_a_client_salt_splits_its_own_tenant_further(make_iso: Factory) -> None:
    iso = await make_iso()
    prompt = long_prompt()
    assert await iso.hit_delta("acme", prompt, cache_salt="user-1") == 0
    assert await iso.hit_delta("acme", prompt, cache_salt="user-2") == 0
    assert await iso.hit_delta("acme", prompt) == 0
    assert await iso.hit_delta("acme", prompt, cache_salt="user-1") > 0


async def test_a_bad_client_salt_is_refused_naming_the_field(make_iso: Factory) -> None:
    iso = await make_iso()
    for bad in ("", "a/b", 7, "x" * 129):
        status, body = await iso.ask("acme", "hello", cache_salt=bad)
        assert status == 400, body
        assert body["error"]["param"] == "cache_salt"


async def test_without_tenants_nothing_is_salted(make_iso: Factory) -> None:
    iso = await make_iso(auth=AuthConfig())
    prompt = long_prompt()
    assert await iso.hit_delta("acme", prompt) == 0  # the key is unknown: the default tenant
    assert await iso.hit_delta("beta", prompt) > 0
