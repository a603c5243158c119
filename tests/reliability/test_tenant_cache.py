"""No tenant ever gets another tenant's cached answer, and the engines' KV blocks are salted apart.

400 deterministic requests from three tenants over a handful of shared questions, through a real
proxy with the in-memory response cache: every hit must be for a question the same tenant asked
before, and the first time a tenant asks is always a miss, however often the others asked it.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import aiohttp
import pytest
from integration.stack import TARGET_MODEL, chat_body, proxy_config, sim

from engine_sidecar.sim.cluster import start_cluster
from proxy.server.app import build_app
from proxy.server.lifecycle import ProxyServer

from .conftest import door_config

KEYS = {"acme": "sk-acme-0000000001", "beta": "sk-beta-0000000002", "gamma": "sk-gamma-00000003"}


@pytest.fixture
async def proxy_url() -> AsyncIterator[str]:
    cluster = await start_cluster([sim(TARGET_MODEL, "t0"), sim(TARGET_MODEL, "t1", seed=1)])
    cfg = proxy_config(cluster.urls, ["t0", "t1"], ["target", "target"])
    server = ProxyServer(cfg, build_app(cfg, door=door_config()))
    await server.start()
    try:
        yield server.url
    finally:
        await server.stop()
        await cluster.close()


async def test_400_requests_three_tenants_no_cross_tenant_hit(proxy_url: str) -> None:
    rng = random.Random(7)
    asked: set[tuple[str, str]] = set()
    hits = 0
    async with aiohttp.ClientSession() as http:
        for i in range(400):
            tenant = rng.choice(sorted(KEYS))
            question = f"shared question {rng.randrange(6)}"
            body = chat_body(question, temperature=0, stream=i % 2 == 0)
            headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
            async with http.post(
                proxy_url + "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                await resp.read()
                assert resp.status == 200
                expected = "HIT" if (tenant, question) in asked else "MISS"
                assert resp.headers["X-Cache"] == expected, (i, tenant, question)
                hits += resp.headers["X-Cache"] == "HIT"
            asked.add((tenant, question))
    assert hits > 300  # the cache was really in play: 18 first asks, the rest answered from it
