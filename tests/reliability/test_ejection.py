"""Outlier ejection on loopback: a hung engine is taken out of its pool after a few requests, probed
after its ejection time and let back in once it answers; a pool that is slow as a whole is not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from integration.stack import TARGET_MODEL, Stack, StackFactory, chat_body, proxy_config, sim

from engine_sidecar.sim.cluster import start_cluster
from proxy.core.config import OutlierConfig, RoutingConfig, UpstreamConfig
from proxy.server.lifecycle import ProxyServer

from .rogue import RogueEngine

# A request to a hung engine ends after connect + first-byte budget: 1 s. The simulated engines
# answer in milliseconds, far inside it even on a busy machine.
UPSTREAM = UpstreamConfig(
    connect_timeout_s=0.2, first_byte_timeout_s=0.8, response_timeout_s=0.8, idle_timeout_s=2.0
)
OUTLIER = OutlierConfig(consecutive_failures=3, base_ejection_s=2.0, max_ejection_s=2.0)
# Round robin: the hung engine gets every third request, whatever its load looks like.
ROUND_ROBIN = RoutingConfig(policy="round_robin")


@pytest.fixture
async def hung(rogue: RogueEngine) -> AsyncIterator[Stack]:
    """Two simulated engines and the rogue one (hung) in the target pool, behind one proxy."""
    rogue.behaviour.completions = "hang"
    cluster = await start_cluster(
        [sim(TARGET_MODEL, "t0", seed=0), sim(TARGET_MODEL, "t1", seed=1)],
        host="127.0.0.1", port=0,
    )
    names = ["t0", "t1", "rogue"]
    cfg = proxy_config([*cluster.urls, rogue.url], names, ["target"] * 3,
                       routing=ROUND_ROBIN, upstream=UPSTREAM, outlier=OUTLIER)
    server = ProxyServer(cfg)
    await server.start()
    http = aiohttp.ClientSession()
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    stack = Stack(cluster, server, http, client, names)
    try:
        await stack.wait_ready()
        yield stack
    finally:
        await client.close()
        await http.close()
        await server.stop()
        await cluster.close()


COMPLETIONS = "/v1/chat/completions"


async def send(stack: Stack, content: str) -> tuple[int, str]:
    """Status and serving engine (errors do not say which engine: ``""``)."""
    resp = await stack.post(COMPLETIONS, chat_body(content, stream=True))
    return resp.status, resp.headers.get("X-Engine", "")


async def outlier(stack: Stack, engine: str) -> dict[str, Any]:
    row: dict[str, Any] = (await stack.admin())[engine]["outlier"]
    return row


async def until_rogue_gets_one(stack: Stack, rogue: RogueEngine, tag: str) -> int:
    """Send requests until one reaches the rogue engine (at most a dozen); its status."""
    before = len(rogue.requests_to(COMPLETIONS))
    for i in range(12):
        status, _ = await send(stack, f"{tag} {i}")
        if len(rogue.requests_to(COMPLETIONS)) > before:
            return status
    raise AssertionError("the rogue engine got none of 12 requests")


async def timeouts(stack: Stack, engine: str) -> float:
    return await stack.metric("kvproxy_requests_total", engine=engine, status="504")


async def wait_state(stack: Stack, engine: str, state: str) -> None:
    async def there() -> bool:
        return (await outlier(stack, engine))["state"] == state

    await stack.wait_for(there, timeout_s=5.0)


async def test_hung_engine_is_ejected_probed_and_let_back_in(
    hung: Stack, rogue: RogueEngine
) -> None:
    stack = hung
    streak = OUTLIER.consecutive_failures
    results = [await send(stack, f"before {i}") for i in range(3 * streak)]
    # Every hung request timed out; the simulated engines answered the rest.
    assert sorted(status for status, _ in results) == [200] * (2 * streak) + [504] * streak
    assert await timeouts(stack, "rogue") == streak
    assert len(rogue.requests_to(COMPLETIONS)) == streak
    row = (await stack.admin())["rogue"]
    assert row["outlier"]["state"] == "ejected", row
    assert row["outlier"]["reason"] == "consecutive_failures"
    assert row["breaker"] == "closed"  # timeouts are backpressure to the breaker: not its doing
    assert row["routable"] is False
    assert await stack.metric(
        "kvproxy_outlier_ejections_total", engine="rogue", reason="consecutive_failures"
    ) == 1
    assert await stack.metric("kvproxy_outlier_ejected_engines", pool="target") == 1
    assert await stack.metric("kvproxy_engine_outlier_state", engine="rogue") == 2

    # Ejected: no more traffic for it, and nothing fails.
    served = [await send(stack, f"during {i}") for i in range(6)]
    assert all(status == 200 and engine != "rogue" for status, engine in served)
    assert len(rogue.requests_to(COMPLETIONS)) == streak

    # Probation while still hung: one probe, which fails and ejects it again.
    await wait_state(stack, "rogue", "probation")
    assert await until_rogue_gets_one(stack, rogue, "probe") == 504
    row = (await stack.admin())["rogue"]["outlier"]
    assert (row["state"], row["reason"], row["ejections"]) == ("ejected", "probe_failed", 2)
    assert len(rogue.requests_to(COMPLETIONS)) == streak + 1
    assert await stack.metric("kvproxy_outlier_ejections_total", reason="probe_failed") == 1

    # It answers again: the next probe restores it and it serves its share.
    rogue.behaviour.completions = "ok"
    await wait_state(stack, "rogue", "probation")
    assert await until_rogue_gets_one(stack, rogue, "back") == 200
    assert (await outlier(stack, "rogue"))["state"] == "active"
    served = [await send(stack, f"after {i}") for i in range(6)]
    assert {status for status, _ in served} == {200}
    assert "rogue" in {engine for _, engine in served}
    assert await stack.metric("kvproxy_outlier_ejected_engines", pool="target") == 0


async def test_uniformly_slow_pool_is_not_ejected(make_stack: StackFactory) -> None:
    """A hot fleet: every engine times out alike, right after serving well. Nobody is an
    outlier, and the proxy keeps routing to all of them."""
    stack = await make_stack(targets=3, routing=ROUND_ROBIN, upstream=UPSTREAM, outlier=OUTLIER)
    rounds = 3 * (OUTLIER.consecutive_failures + 1)
    fine = [await send(stack, f"fine {i}") for i in range(rounds)]
    assert {status for status, _ in fine} == {200}
    for name in stack.names:
        await stack.faults(name, header_delay_s=3.0)
    slow = [await send(stack, f"slow {i}") for i in range(rounds)]
    assert {status for status, _ in slow} == {504}
    for name in stack.names:  # each timed out more often than the streak that ejects
        assert await timeouts(stack, name) > OUTLIER.consecutive_failures
    rows = await stack.admin()
    assert {row["outlier"]["state"] for row in rows.values()} == {"active"}, rows
    assert await stack.metric("kvproxy_outlier_ejections_total") == 0
