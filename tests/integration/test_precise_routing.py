"""Precise routing end to end on loopback: two simulated engines that tokenize with a real
tokenizer file and publish vLLM's KV events, the proxy subscribed to both with the same tokenizer.

The proxy's index for an engine holds exactly the blocks the engine reported (as an independent
subscriber records them), and a request sharing a prefix that only the engine's events can have
told the proxy about (the first request went to the engine directly) is routed there. When a
publisher dies, its engine falls back to the approximate index, visibly, and is still served."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sim.kv_subscriber import Subscriber, replay, reported_blocks
from tokenizer_files import make_tokenizer_dir

from engine_sidecar.sim.cluster import SimCluster, start_cluster
from engine_sidecar.sim.kvevents import KvEventsSettings
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.kv_config import EngineEvents
from proxy.fleet.precise import INLINE_CHARS, PreciseRouting
from proxy.server.keys import SHELL
from proxy.server.lifecycle import ProxyServer

from .stack import TARGET_MODEL, proxy_config, sim

NAMES = ["t0", "t1"]


@dataclass
class Precise:
    cluster: SimCluster
    server: ProxyServer
    http: aiohttp.ClientSession
    subscribers: dict[str, Subscriber]
    replays: dict[str, str]

    def proxy_blocks(self, name: str) -> set[int]:
        precise = self.server.app[SHELL].precise
        assert precise is not None
        return precise.listeners[name].index.keys()

    async def admin(self) -> dict[str, dict[str, Any]]:
        async with self.http.get(self.server.url + "/admin/engines") as resp:
            return {row["name"]: row for row in (await resp.json())["engines"]}

    async def until(self, check: Any, what: str, timeout_s: float = 15.0) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not await check():  # noqa: ASYNC110 (polls over HTTP)
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None

    async def reported(self, name: str) -> set[bytes | int]:
        """What engine ``name`` reported so far (gaps filled from its replay socket)."""
        sub = self.subscribers[name]
        while await sub.receive(0.05) is not None:
            pass
        for batch in await replay(self.replays[name], 0):  # what came before it connected
            sub.batches.setdefault(batch.seq, batch)
        return reported_blocks(sub.events())


def _local(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


@pytest.fixture
async def precise(tmp_path: Path) -> AsyncIterator[Precise]:
    tok = str(make_tokenizer_dir(tmp_path / "tok"))
    events = KvEventsSettings(endpoint="tcp://*:0", replay_endpoint="tcp://127.0.0.1:0")
    configs = [sim(TARGET_MODEL, name, seed=i, tokenizer=tok, kv_events=events)
               for i, name in enumerate(NAMES)]
    cluster = await start_cluster(configs, host="127.0.0.1", port=0)
    publishers = [engine.kv_events for engine in cluster.engines]
    ends = {n: (_local(p.endpoint), p.replay_endpoint) for n, p in zip(NAMES, publishers,
                                                                        strict=True) if p}
    base = proxy_config(cluster.urls, NAMES, ["target"] * 2)
    engines = tuple(EngineConfig(n, url, kv_events=EngineEvents(*ends[n]))
                    for n, url in zip(NAMES, cluster.urls, strict=True))
    cfg = replace(base, pools=(PoolConfig("target", TARGET_MODEL, engines, tokenizer=tok,
                                          priority_scheduling=True),))
    server = ProxyServer(cfg)
    await server.start()
    subscribers = {n: Subscriber(connect=ends[n][0]) for n in NAMES}
    http = aiohttp.ClientSession()
    try:
        yield Precise(cluster, server, http, subscribers,
                      {n: str(ends[n][1]) for n in NAMES})
    finally:
        await http.close()
        for sub in subscribers.values():
            sub.close()
        await server.stop()
        await cluster.close()


def _chat(prefix: str, question: str) -> dict[str, Any]:
    return {"model": TARGET_MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": prefix},
                         {"role": "user", "content": question}]}


async def _encoding_threads(precise: Precise, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Once both engines are in sync: the list that gets, for each prompt the proxy encodes, the
    name of the thread that encoded it."""
    threads: list[str] = []
    encoded = PreciseRouting._encoded

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return encoded(*args)

    monkeypatch.setattr(PreciseRouting, "_encoded", staticmethod(spy))

    async def all_precise() -> bool:
        return all(r["kv_events"]["mode"] == "precise" for r in (await precise.admin()).values())

    await precise.until(all_precise, "both engines precise")
    return threads


@pytest.mark.parametrize("repeats", [12, 60], ids=["inline", "on-the-thread-pool"])
async def test_the_index_is_what_engines_reported_and_shared_prefixes_follow_it(
        precise: Precise, repeats: int, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = await _encoding_threads(precise, monkeypatch)
    sentence = "the proxy keeps an exact index of what engines hold. "
    prefixes = [f"{uuid.uuid4().hex} " + sentence * repeats for _ in range(6)]
    # Prompts past INLINE_CHARS are encoded off the event loop; shorter ones on it.
    assert (len(prefixes[0]) > INLINE_CHARS) == (repeats == 60)
    homes = [NAMES[k % 2] for k in range(len(prefixes))]
    for prefix, home in zip(prefixes, homes, strict=True):
        # Straight to the engine: only its KV events can tell the proxy.
        url = precise.cluster.urls[NAMES.index(home)] + "/v1/chat/completions"
        async with precise.http.post(url, json=_chat(prefix, "first question")) as resp:
            assert resp.status == 200, await resp.text()
    for name in NAMES:
        async def same(name: str = name) -> bool:
            return precise.proxy_blocks(name) == await precise.reported(name)

        await precise.until(same, f"{name}'s index to match its events")
        assert precise.proxy_blocks(name)
    served = []
    for prefix in prefixes:
        async with precise.http.post(precise.server.url + "/v1/chat/completions",
                                     json=_chat(prefix, "a second, different question")) as resp:
            assert resp.status == 200, await resp.text()
            served.append(resp.headers["X-Engine"])
    assert served == homes
    on_pool = [t.startswith("kvproxy-tokenize") for t in threads]
    assert len(threads) == len(prefixes) and all(on_pool) == (repeats == 60) and any(
        on_pool) == (repeats == 60)
    for name in NAMES:  # and after requests through the proxy, exactly again
        async def again(name: str = name) -> bool:
            return precise.proxy_blocks(name) == await precise.reported(name)

        await precise.until(again, f"{name}'s index to match its events after proxied requests")
    rows = await precise.admin()
    assert rows["t0"]["kv_events"]["blocks"] == len(precise.proxy_blocks("t0"))
    assert rows["t0"]["kv_events"]["last_seq"] is not None


async def test_a_short_message_with_large_tools_is_encoded_off_the_event_loop(
        precise: Precise, monkeypatch: pytest.MonkeyPatch) -> None:
    # The template renders the tools too: the body's size, not the messages' text, decides.
    threads = await _encoding_threads(precise, monkeypatch)
    fields = {f"field_{k}": {"type": "string", "description": "the proxy routes " * 4}
              for k in range(64)}
    body = {**_chat("short system prompt", "which tool?"),
            "tools": [{"type": "function", "function": {
                "name": "lookup", "parameters": {"type": "object", "properties": fields}}}]}
    assert len(str(body["messages"])) < INLINE_CHARS < len(str(body["tools"]))
    async with precise.http.post(precise.server.url + "/v1/chat/completions",
                                 json=body) as resp:
        assert resp.status == 200, await resp.text()
    assert len(threads) == 1 and threads[0].startswith("kvproxy-tokenize"), threads


async def test_a_dead_publisher_falls_back_to_the_approximate_index(precise: Precise) -> None:
    async def mode(name: str) -> str:
        return str((await precise.admin())[name]["kv_events"]["mode"])

    async def t0_precise() -> bool:
        return await mode("t0") == "precise"

    await precise.until(t0_precise, "t0 precise")
    publisher = precise.cluster.engines[0].kv_events
    assert publisher is not None
    await publisher.close()

    async def t0_approximate() -> bool:
        return await mode("t0") == "approximate"

    await precise.until(t0_approximate, "t0 to fall back")
    async with precise.http.get(precise.server.url + "/metrics") as resp:
        text = await resp.text()
    assert 'kvproxy_kv_event_fallbacks_total{engine="t0",state="disconnected"} 1.0' in text
    assert 'kvproxy_kv_precise{engine="t0"} 0.0' in text
    for i in range(4):
        body = _chat(f"still served {i} " * 30, "q")
        async with precise.http.post(precise.server.url + "/v1/chat/completions",
                                     json=body) as resp:
            assert resp.status == 200, await resp.text()


async def test_the_simulator_refuses_token_ids_outside_its_models_vocabulary(
        precise: Precise) -> None:
    # As vLLM does (a 400 naming the id), never a 500 that would charge the engine's breaker.
    url = precise.cluster.urls[0] + "/v1/completions"
    for bad in (2**32, 2**40, 399_999, -1):
        body = {"model": TARGET_MODEL, "max_tokens": 1, "prompt": [5, bad, 6]}
        async with precise.http.post(url, json=body) as resp:
            assert resp.status == 400, (bad, await resp.text())
            assert "out of vocabulary" in (await resp.json())["error"]["message"] or bad < 0
