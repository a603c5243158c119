"""The proxy (``kvproxy serve``, a real subprocess) in front of the backend's two engines: requests
sharing a long prefix stick to one engine, whose own prefix-cache counters show the reuse, and the
``openai`` SDK streams through the proxy."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio

from contract.client import (
    Backend,
    Engine,
    metric,
    poll,
    scrape,
    settled_metric,
    value,
    wait_until,
)
from contract.conftest import free_port

HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
GENERATED = "vllm:generation_tokens_total"
LONG = 2000


@dataclass
class Proxy:
    url: str
    engines: dict[str, Engine]


def proxy_config(backend: Backend, port: int) -> str:
    engines = "".join(
        f'  [[pools.engines]]\n  name = "{name}"\n  url = "{e.url}"\n'
        f'  metrics_url = "{e.metrics_url}"\n'
        for name, e in (("a", backend.a), ("b", backend.b)))
    # Small prefix blocks: the shared prefix below spans several of them.
    return (f'[server]\nhost = "127.0.0.1"\nport = {port}\n'
            f'[routing]\npolicy = "prefix_affinity"\nblock_chars = 256\n'
            f'[[pools]]\nname = "target"\nmodel = "{backend.model}"\n{engines}')


def start_proxy(cfg: Path) -> subprocess.Popen[bytes]:
    with (cfg.parent / "proxy.log").open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--config", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))


def proxy_log(cfg: Path) -> str:
    return (cfg.parent / "proxy.log").read_text(errors="replace")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def proxy(backend: Backend, tmp_path_factory: pytest.TempPathFactory
                ) -> AsyncIterator[Proxy]:
    port = free_port()
    cfg = tmp_path_factory.mktemp("proxy") / "kvproxy.toml"
    cfg.write_text(proxy_config(backend, port))
    proc = start_proxy(cfg)
    url = f"http://127.0.0.1:{port}"
    try:
        async def ready() -> bool:
            assert proc.poll() is None, proxy_log(cfg)
            try:
                async with aiohttp.ClientSession() as s, s.get(url + "/ready") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await wait_until(ready, timeout_s=30, what="proxy ready")
        yield Proxy(url, {"a": backend.a, "b": backend.b})
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


SHARED = " ".join(f"Rule {i}: answer briefly and cite the cache block you used." for i in range(30))


async def test_shared_prefix_sticks_to_one_engine(backend: Backend, proxy: Proxy) -> None:
    before = {n: value(await scrape(e.metrics_url), HITS) for n, e in proxy.engines.items()}
    served_by = []
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            body = {"model": backend.model, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": SHARED},
                                 {"role": "user", "content": f"question number {i}"}]}
            async with s.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
                served_by.append(resp.headers["X-Engine"])
    assert len(set(served_by)) == 1, served_by
    home = served_by[0]
    other = "b" if home == "a" else "a"
    after = {n: value(await scrape(e.metrics_url), HITS) for n, e in proxy.engines.items()}
    # Five repeats of a prefix of many KV blocks: the home engine's own counters show the reuse.
    assert after[home] - before[home] >= 5 * 4 * backend.block_size
    assert after[other] == before[other]


async def test_openai_sdk_streams_through_the_proxy(backend: Backend, proxy: Proxy) -> None:
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=backend.model, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Say something about caches."}])
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == 10
        assert "".join(pieces)
        completion = await client.completions.create(model=backend.model, prompt="Once upon",
                                                      max_tokens=5, temperature=0)
        assert completion.usage is not None and completion.usage.completion_tokens == 5
    finally:
        await client.close()


async def test_vllm_streams_take_the_raw_chunk_path(backend: Backend, proxy: Proxy) -> None:
    """vLLM (uvicorn) writes each event as one whole HTTP chunk, so once the proxy's parser stands
    between two chunks the stream's reads go on to the client as they came. Each attempt asks
    something new: a repeated prompt at temperature 0 would be answered from the response cache,
    never relayed. An answer that came whole in the proxy's first read proves nothing either way
    (a loaded machine can hold the proxy up that long), so such an attempt is repeated; an engine
    whose framing the raw path never takes fails every attempt."""
    raw = "kvproxy_relay_raw_streams_total"
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    try:
        for attempt in range(5):
            before = await metric(proxy.url + "/metrics", raw)
            stream = await client.chat.completions.create(
                model=backend.model, max_tokens=96, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"Tell long story {uuid.uuid4().hex} "
                                                      f"about caches, attempt {attempt}."}])
            chunks = [chunk async for chunk in stream]
            assert len(chunks) >= 2

            async def counted(before: float = before) -> bool:
                # The count follows the engine's last chunk, which can trail the client's [DONE].
                return await metric(proxy.url + "/metrics", raw) >= before + 1

            if await poll(counted, timeout_s=2.0):
                return
    finally:
        await client.close()
    pytest.fail("no stream of five went the raw way")


async def test_usage_asked_for_the_tenant_is_not_shown_to_the_client(
    backend: Backend, proxy: Proxy
) -> None:
    tokens = "kvproxy_tenant_tokens_total"
    before = await metric(proxy.url + "/metrics", tokens, tenant="default", kind="completion")
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=backend.model, max_tokens=6, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Say something about tenants."}])
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    after = await metric(proxy.url + "/metrics", tokens, tenant="default", kind="completion")
    assert after - before == 6


async def test_proxy_shows_engine_telemetry(backend: Backend, proxy: Proxy) -> None:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/admin/engines") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert '"a"' in text and '"b"' in text


async def test_client_disconnect_through_the_proxy_aborts_in_the_engine(
        backend: Backend, proxy: Proxy) -> None:
    body = {"model": backend.model, "prompt": "abort through the proxy", "max_tokens": LONG,
            "ignore_eos": True, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(proxy.url + "/v1/completions", json=body)
        assert resp.status == 200
        engine = proxy.engines[resp.headers["X-Engine"]]
        before = await metric(engine.metrics_url, GENERATED)
        for _ in range(5):
            await resp.content.readline()
        # Closed as soon as tokens flow: every moment it stays open lets the engine run on toward
        # LONG. vLLM's running gauge can trail the relayed tokens on a loaded machine, so the
        # verdict rests on the token counter: it must settle short of the whole request.
        resp.close()

    async def idle() -> bool:
        return await metric(engine.metrics_url, RUNNING) == 0

    await wait_until(idle, timeout_s=20, what="the engine to drop the request")
    settled = await settled_metric(engine.metrics_url, GENERATED)
    assert settled - before < LONG, "the request ran to its end after the client left"
