"""Proxy replicas sharing Redis: limits across processes, Redis dying under load, breakers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from conftest import StackFactory
from proxystack import KEYS, MODEL, chat, door_config, sim
from redisproc import SLOW_OK, RedisFactory, RedisServer

from engine_sidecar.sim.cluster import SimCluster, start_cluster
from proxy.core.door_config import RedisConfig
from proxy.tenancy.redis_link import RedisLink
from proxy.tenancy.shared_state import EngineRecord, heartbeat_engine, record_key

HERE = Path(__file__).parent


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    c = await start_cluster([sim("t0", seed=0), sim("t1", seed=1)], host="127.0.0.1", port=0)
    try:
        yield c
    finally:
        await c.close()


class ProxyProcess:
    """One ``proxystack.py`` proxy in its own process; stopped by its PID."""

    def __init__(self, spec_path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "proxystack.py"), str(spec_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.url = ""

    async def started(self) -> str:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 30)
        self.url = line.decode().strip()
        assert self.url.startswith("http://"), "proxy process did not start"
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


async def wait_ready(http: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(10):
        while True:
            async with http.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.05)


async def test_limits_hold_across_two_proxy_processes(
    cluster: SimCluster, redis_server: RedisServer, tmp_path: Path
) -> None:
    spec = {
        "urls": cluster.urls,
        "names": [e.name for e in cluster.engines],
        "models": [MODEL, MODEL],
        "door": {
            "redis_url": redis_server.url,
            "backend": "redis",
            "limits": {"enabled": True, "requests_per_min": 12},
        },
    }
    spec_path = tmp_path / "proxy.json"
    spec_path.write_text(json.dumps(spec))
    procs = [ProxyProcess(spec_path), ProxyProcess(spec_path)]
    try:
        urls = [await p.started() for p in procs]
        async with aiohttp.ClientSession() as http:
            for url in urls:
                await wait_ready(http, url)
            headers = {"Authorization": f"Bearer {KEYS['acme']}"}

            async def one(i: int) -> tuple[int, str | None]:
                body = chat(f"question {i}", temperature=0.5)  # not cacheable: every one counts
                async with http.post(
                    urls[i % 2] + "/v1/chat/completions", json=body, headers=headers
                ) as resp:
                    await resp.read()
                    return resp.status, resp.headers.get("Retry-After")

            results = await asyncio.gather(*(one(i) for i in range(30)))
            # Another tenant still has its own allowance.
            async with http.post(
                urls[1] + "/v1/chat/completions",
                json=chat("beta's turn", temperature=0.5),
                headers={"Authorization": f"Bearer {KEYS['beta']}"},
            ) as resp:
                assert resp.status == 200
            async with http.get(urls[0] + "/metrics") as resp:
                text = await resp.text()
    finally:
        for p in procs:
            p.stop()
    statuses = [s for s, _ in results]
    assert statuses.count(200) == 12 and statuses.count(429) == 18
    assert all(int(ra) >= 1 for s, ra in results if s == 429 and ra is not None)
    assert all(ra is not None for s, ra in results if s == 429)
    assert 'kvproxy_ratelimit_rejections_total{limit="requests_per_min",tenant="acme"}' in text


async def test_concurrent_stream_limit_through_the_proxy(
    make_stack: StackFactory, redis_server: RedisServer
) -> None:
    door = door_config(
        redis_url=redis_server.url, limits={"enabled": True, "concurrent_streams": 2}
    )
    stack = await make_stack(door)
    await stack.faults(header_delay_s=0.4)
    results = await asyncio.gather(*(stack.post(chat(f"q{i}", temperature=0.5)) for i in range(5)))
    statuses = sorted(r.status for r, _ in results)
    assert statuses == [200, 200, 429, 429, 429]
    refused = [raw for r, raw in results if r.status == 429]
    assert b'"type":"rate_limit_error"' in refused[0]
    assert b'"code":"concurrent_streams"' in refused[0]
    await stack.clear_faults()
    resp, _ = await stack.post(chat("after", temperature=0.5))
    assert resp.status == 200  # leases were released
    assert (
        await stack.metric(
            "kvproxy_ratelimit_rejections_total", tenant="acme", limit="concurrent_streams"
        )
        == 3
    )


async def test_redis_killed_during_load_causes_no_client_errors(
    make_stack: StackFactory, redis_factory: RedisFactory
) -> None:
    server = redis_factory.start()
    door = door_config(
        redis_url=server.url,
        backend="redis",
        limits={"enabled": True, "requests_per_min": 100_000, "concurrent_streams": 1000},
        redis={"op_timeout_s": 0.2, "retry_after_failure_s": 0.3},
    )
    stack = await make_stack(door)
    statuses: list[int] = []
    stop = asyncio.Event()

    async def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            stream = i % 2 == 0
            body = chat(f"client {n} question {i % 5}", stream=stream)  # repeats: cache traffic
            resp, raw = await stack.post(body, tenant=("acme", "beta")[n % 2])
            statuses.append(resp.status)
            if stream:
                assert raw.endswith(b"data: [DONE]\n\n")

    async def felt() -> bool:
        # The proxy's Redis calls have failed: the requests since were served without it.
        return (await stack.metric("kvproxy_redis_errors_total") >= 1
                and await stack.metric("kvproxy_cache_errors_total") >= 1)

    clients = [asyncio.create_task(client(n)) for n in range(8)]
    try:
        async with asyncio.timeout(20):
            while len(statuses) <= 10:  # noqa: ASYNC110 - polls the clients' answers
                await asyncio.sleep(0.05)
        before = len(statuses)
        server.stop()  # SIGKILL, mid-load
        async with asyncio.timeout(20):
            while len(statuses) <= before + 10 or not await felt():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert set(statuses) == {200}


async def test_breaker_opened_by_one_replica_reaches_the_other(
    make_stack: StackFactory, redis_server: RedisServer, cluster: SimCluster
) -> None:
    door = door_config(redis_url=redis_server.url)
    first = await make_stack(door, cluster=cluster)
    second = await make_stack(door, cluster=cluster)

    async def breakers(stack: object) -> dict[str, str]:
        async with first.http.get(stack.url + "/admin/engines") as resp:  # type: ignore[attr-defined]
            rows = (await resp.json())["engines"]
        return {row["name"]: row["breaker"] for row in rows}

    await first.faults(error_rate=1.0, error_status=500)
    for i in range(6):  # enough failures to open both engines' breakers at the first proxy
        await first.post(chat(f"fail {i}", temperature=0.5))
    await first.clear_faults()
    assert "open" in (await breakers(first)).values()
    opened = {n for n, state in (await breakers(first)).items() if state == "open"}
    # Only the shared breaker state can open them at the second proxy (asserted below).
    async with asyncio.timeout(10.0):
        while not opened <= {n for n, s in (await breakers(second)).items() if s == "open"}:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    # The second proxy never sent a request to the failing engines itself.
    assert await second.metric("kvproxy_upstream_errors_total") == 0


async def test_tokens_per_minute_through_the_proxy(make_stack: StackFactory) -> None:
    stack = await make_stack(door_config(limits={"enabled": True, "tokens_per_min": 20}))
    first, raw = await stack.post(chat("a prompt that costs tokens " * 5, temperature=0.5))
    assert first.status == 200
    usage = json.loads(raw)["usage"]["total_tokens"]
    assert usage > 20  # the answer put the tenant in debt
    second, body = await stack.post(chat("one more", temperature=0.5))
    assert second.status == 429 and b'"code":"tokens_per_min"' in body
    assert int(second.headers["Retry-After"]) >= (usage - 20) * 60 // 20
    # Streamed without asking for usage: the proxy asks the engine for it and charges it (an
    # engine that sends none is charged by estimate: tests/reliability/test_usage_estimate.py).
    other, _ = await stack.post(chat("x" * 400, temperature=0.5, stream=True), tenant="beta")
    assert other.status == 200
    again, _ = await stack.post(chat("y", temperature=0.5, stream=True), tenant="beta")
    assert again.status == 429


async def test_engines_discovered_from_the_registry(
    make_stack: StackFactory, redis_server: RedisServer
) -> None:
    async with registered_engine(redis_server) as sidecar:
        door = door_config(redis_url=redis_server.url, redis={"discover_engines": True})
        stack = await make_stack(door, engines=1)

        async def engines() -> dict[str, str]:
            async with stack.http.get(stack.url + "/admin/engines") as resp:
                return {r["name"]: r["health"] for r in (await resp.json())["engines"]}

        async with asyncio.timeout(5):
            while (await engines()).get("reg0") != "healthy":  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        results = [await stack.post(chat(f"spread {i}", temperature=0.5)) for i in range(12)]
        assert {r.headers["X-Engine"] for r, _ in results} == {"t0", "reg0"}
        await sidecar.leave()  # its key is deleted
        async with asyncio.timeout(5):
            while "reg0" in await engines():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        resp, _ = await stack.post(chat("after", temperature=0.5))
        assert resp.status == 200 and resp.headers["X-Engine"] == "t0"


async def test_a_registered_engine_is_known_when_the_proxy_starts_listening(
    make_stack: StackFactory, redis_server: RedisServer
) -> None:
    """The first scrape round waits for the registry's first read: a proxy that listens knows
    the engines registered before it started, not only the configured ones."""
    async with registered_engine(redis_server) as sidecar:
        async with asyncio.timeout(5):
            while not await sidecar.registered():  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        door = door_config(redis_url=redis_server.url, redis={"discover_engines": True})
        stack = await make_stack(door, engines=1)
        async with stack.http.get(stack.url + "/admin/engines") as resp:
            health = {r["name"]: r["health"] for r in (await resp.json())["engines"]}
        assert health == {"t0": "healthy", "reg0": "healthy"}


class _Sidecar:
    """A simulated engine registered in Redis the way the vLLM sidecar registers its engine."""

    def __init__(self, link: RedisLink, url: str) -> None:
        self._link, self.url = link, url
        self._stop = asyncio.Event()
        record = EngineRecord("reg0", "target", MODEL, url)
        self._beat = asyncio.create_task(heartbeat_engine(link, record, ttl_s=3, stop=self._stop))

    async def registered(self) -> bool:
        key = record_key(self._link, "target", self.url)
        return bool(await self._link.run("exists", lambda r: r.exists(key)))

    async def leave(self) -> None:
        self._stop.set()
        await self._beat


@contextlib.asynccontextmanager
async def registered_engine(redis_server: RedisServer) -> AsyncIterator[_Sidecar]:
    extra = await start_cluster([sim("reg0", seed=5)], host="127.0.0.1", port=0)
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    sidecar = _Sidecar(link, extra.urls[0])
    try:
        yield sidecar
    finally:
        await sidecar.leave()
        await link.close()
        await extra.close()
