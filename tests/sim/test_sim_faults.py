"""Every fault mode, set through ``/admin/faults`` or the engine config."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import pytest

from engine_sidecar.sim.config import FaultConfig, SimEngineConfig

from .conftest import FAST, Start, chat_body, metric, parse_sse


async def set_faults(http: aiohttp.ClientSession, url: str, **faults: object) -> None:
    async with http.post(url + "/admin/faults", json=faults) as resp:
        assert resp.status == 200, await resp.text()


async def test_error_rate_answers_the_configured_status(start: Start,
                                                        http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url = cluster.urls[0]
    await set_faults(http, url, error_rate=1.0, error_status=503)
    async with http.post(url + "/v1/chat/completions",
                         json=chat_body("hi", stream=True)) as resp:
        assert resp.status == 503
        err = (await resp.json())["error"]
    assert err["code"] == 503
    assert err["type"] == "ServiceUnavailableError"
    await set_faults(http, url, error_rate=0.5, error_status=500)
    statuses = []
    for _ in range(40):
        async with http.post(url + "/v1/completions",
                             json={"prompt": "x", "max_tokens": 1}) as resp:
            statuses.append(resp.status)
    assert set(statuses) == {200, 500}


async def test_error_fault_from_config(start: Start, http: aiohttp.ClientSession) -> None:
    cfg = SimEngineConfig(time_scale=FAST, faults=FaultConfig(error_rate=1.0, error_status=502))
    cluster = await start(cfg)
    async with http.post(cluster.urls[0] + "/v1/chat/completions", json=chat_body("hi")) as resp:
        assert resp.status == 502


async def test_reset_after_tokens_cuts_the_stream(start: Start,
                                                  http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url, engine = cluster.urls[0], cluster.engines[0]
    await set_faults(http, url, reset_after_tokens=3)
    body = chat_body("hi", max_tokens=50, ignore_eos=True, stream=True)
    received = b""
    with pytest.raises(aiohttp.ClientError):
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                received += chunk
    events = parse_sse(received.rsplit(b"\n\n", 1)[0] + b"\n\n")
    assert "[DONE]" not in events
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert len(text) == 3 * 4
    assert len(engine.aborted_ids) == 1
    with pytest.raises(aiohttp.ClientError):
        async with http.post(url + "/v1/chat/completions", json=chat_body("hi")) as resp:
            await resp.read()


async def test_stall_mid_stream(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url = cluster.urls[0]
    await set_faults(http, url, stall_after_tokens=2, stall_s=0.4)
    body = chat_body("hi", max_tokens=6, ignore_eos=True, stream=True)
    loop = asyncio.get_running_loop()
    arrivals: list[tuple[float, bytes]] = []
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        while True:
            line = await resp.content.readuntil(b"\n\n")
            arrivals.append((loop.time(), line))
            if line.startswith(b"data: [DONE]"):
                break
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) >= 0.35
    content = [line for _, line in arrivals if b'"content":" ' in line]
    assert b"".join(content).count(b'"content":" ') >= 1


async def test_slow_headers(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url = cluster.urls[0]
    await set_faults(http, url, header_delay_s=0.3)
    loop = asyncio.get_running_loop()
    began = loop.time()
    async with http.post(url + "/v1/chat/completions", json=chat_body("hi", max_tokens=1)) as resp:
        assert resp.status == 200
        assert loop.time() - began >= 0.25
        await resp.read()


async def test_metrics_faults(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url = cluster.urls[0]
    await set_faults(http, url, metrics_status=503)
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 503
    await set_faults(http, url, metrics_status=None, metrics_frozen=True)
    frozen = await metric(http, url, "vllm:generation_tokens_total")
    async with http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}) as r:
        await r.read()
    assert await metric(http, url, "vllm:generation_tokens_total") == frozen
    await set_faults(http, url, metrics_frozen=False,
                     metrics_missing=["vllm:num_requests_waiting"],
                     metric_overrides={"vllm:kv_cache_usage_perc": 0.93})
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    assert "vllm:num_requests_waiting" not in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.93' in text
    assert await metric(http, url, "vllm:generation_tokens_total") > frozen


async def test_admin_faults_validation_and_clear(start: Start,
                                                 http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url, engine = cluster.urls[0], cluster.engines[0]
    for bad in ({"error_rate": 2}, {"bogus": 1}, {"metrics_missing": "x"},
                {"error_rate": 1.0, "stall_s": -1}):
        async with http.post(url + "/admin/faults", json=bad) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == 400
    assert engine.faults == FaultConfig()
    await set_faults(http, url, error_rate=1.0, header_delay_s=0.01)
    async with http.get(url + "/admin/faults") as resp:
        assert (await resp.json())["error_rate"] == 1.0
    async with http.delete(url + "/admin/faults") as resp:
        assert resp.status == 200
    assert engine.faults == FaultConfig()
    async with http.post(url + "/v1/chat/completions", json=chat_body("hi", max_tokens=1)) as r:
        assert r.status == 200


async def test_close_does_not_wait_for_a_stalled_response(start: Start,
                                                          http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url = cluster.urls[0]
    await set_faults(http, url, stall_after_tokens=1, stall_s=60)
    body = chat_body("hi", max_tokens=50, ignore_eos=True, stream=True)
    loop = asyncio.get_running_loop()
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")
        began = loop.time()
        await cluster.close()
        assert loop.time() - began < 20
