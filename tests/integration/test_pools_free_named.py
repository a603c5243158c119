"""Any fleet: three free-named pools, a LoRA name, a tier-chain alias and a plain alias, routed,
degraded and shed as configured; a model an engine does not serve is reported at start-up."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from engine_sidecar.sim.cluster import start_cluster
from proxy.core.config import Config, PressureConfig
from proxy.core.fleet_config import AliasConfig, EngineConfig, PoolConfig
from proxy.server.lifecycle import ProxyServer

from .stack import Stack, proxy_config, sim

BIG, MID, TINY = "llama-70b", "llama-8b", "llama-1b"
LORA = "llama-8b-sql-lora"  # configured for the mid pool; its engine does not serve it
ENGINES = {"b0": ("big", BIG), "b1": ("big", BIG), "m0": ("mid", MID), "s0": ("tiny", TINY)}


def _config(urls: list[str]) -> Config:
    names = list(ENGINES)
    engines = {n: EngineConfig(n, u) for n, u in zip(names, urls, strict=True)}
    pools = (
        PoolConfig("big", BIG, (engines["b0"], engines["b1"])),
        PoolConfig("mid", engines=(engines["m0"],), models=(MID, LORA)),
        PoolConfig("tiny", TINY, (engines["s0"],)),
    )
    aliases = (AliasConfig("chat", pools=("big", "mid", "tiny")), AliasConfig("fast", "tiny"))
    # The loopback stack's timings, with this fleet's pools and aliases. The KV overcommit guard is
    # off: the injected usage jumps from idle to hot in one scrape, which it rightly reads as
    # growth; here only the class thresholds and the tier chain are under test.
    base = proxy_config(urls[:1], ["x"], ["target"])
    return dataclasses.replace(
        base, pools=pools, aliases=aliases, pressure=PressureConfig(enabled=False)
    )


@pytest.fixture
async def fleet(caplog: pytest.LogCaptureFixture) -> AsyncIterator[Stack]:
    caplog.set_level(logging.INFO, logger="proxy.fleet.discovery")
    configs = [sim(model, name, seed=i) for i, (name, (_, model)) in enumerate(ENGINES.items())]
    cluster = await start_cluster(configs, host="127.0.0.1", port=0)
    server = ProxyServer(_config(cluster.urls))
    await server.start()
    http = aiohttp.ClientSession()
    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=20.0
    )
    stack = Stack(cluster, server, http, client, list(ENGINES))
    try:
        await stack.wait_ready()
        yield stack
    finally:
        await client.close()
        await http.close()
        await server.stop()
        await cluster.close()


async def _ask(stack: Stack, model: str, priority: str = "standard") -> aiohttp.ClientResponse:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return await stack.post("/v1/chat/completions", body, **{"X-Priority": priority})


async def _heat(stack: Stack, *names: str) -> None:
    # Over the sheddable mark (0.85), under the standard one (0.95).
    for name in names:
        await stack.faults(name, metric_overrides={"vllm:kv_cache_usage_perc": 0.9})

    async def seen() -> bool:
        rows = await stack.admin()
        return all(rows[n]["snapshot"]["kv_usage"] == pytest.approx(0.9) for n in names)

    await stack.wait_for(seen)


async def test_models_are_listed_like_openai(fleet: Stack) -> None:
    listed = {m.id: m for m in (await fleet.client.models.list()).data}
    assert set(listed) == {BIG, MID, LORA, TINY, "chat", "fast"}
    chat = await fleet.client.models.retrieve("chat")
    assert chat.id == "chat" and chat.object == "model"
    assert chat.model_extra is not None and chat.model_extra["pools"] == ["big", "mid", "tiny"]
    with pytest.raises(openai.NotFoundError) as info:
        await fleet.client.models.retrieve("gpt-9")
    error = info.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"


async def test_routes_degrades_along_the_chain_and_sheds(fleet: Stack) -> None:
    served = {m: (await _ask(fleet, m)).headers["X-Served-By"] for m in ("chat", "fast", MID)}
    assert served == {"chat": "big", "fast": "tiny", MID: "mid"}

    await _heat(fleet, "b0", "b1")
    first = await _ask(fleet, "chat", "sheddable")
    assert first.status == 200 and first.headers["X-Served-By"] == "mid"
    standard = await _ask(fleet, "chat")
    assert standard.headers["X-Served-By"] == "big"  # only sheddable work degrades

    await _heat(fleet, "m0")
    second = await _ask(fleet, "chat", "sheddable")
    assert second.status == 200 and second.headers["X-Served-By"] == "tiny"
    assert await fleet.metric("kvproxy_degraded_total", from_pool="big", to_pool="mid") == 1
    assert await fleet.metric("kvproxy_degraded_total", from_pool="big", to_pool="tiny") == 1

    await _heat(fleet, "s0")
    shed = await _ask(fleet, "chat", "sheddable")
    assert shed.status == 503 and shed.headers["X-Kvproxy-Shed-Reason"] == "kv_pressure"
    assert (await _ask(fleet, "fast", "sheddable")).status == 503
    assert await fleet.metric("kvproxy_shed_total", pool="big", reason="kv_pressure") == 1


async def test_engine_not_serving_a_configured_model_is_reported(
    fleet: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    async def reported() -> bool:
        models = (await fleet.admin())["m0"]["models"]
        return models is not None and models["served"] is not None

    await fleet.wait_for(reported)
    rows = await fleet.admin()
    assert rows["m0"]["models"] == {"served": [MID], "missing": [LORA], "error": None}
    assert rows["b0"]["models"]["missing"] == []
    records = caplog.get_records("setup") + caplog.records  # logged once, at start-up
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("pool mid" in w and "engine m0" in w and LORA in w for w in warnings), warnings


async def test_an_engines_model_names_cannot_forge_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.fleet.discovery")
    evil = "want-not\n\x1b[31m2026-01-01 ERROR forged line"
    cluster = await start_cluster([sim(evil, "e0")], host="127.0.0.1", port=0)
    base = proxy_config(cluster.urls, ["e0"], ["target"])
    server = ProxyServer(dataclasses.replace(
        base, pools=(PoolConfig("target", "want", (EngineConfig("e0", cluster.urls[0]),)),),
        aliases=()))
    await server.start()
    try:
        async with asyncio.timeout(10):
            while not any("does not serve" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        await server.stop()
        await cluster.close()
    line = next(r.getMessage() for r in caplog.records if "does not serve" in r.getMessage())
    assert "\n" not in line and "\x1b" not in line
    assert repr(evil) in line
