"""Simulated restarts with a new schedule obey the pool's rules: one restart of an engine at a
time, and the admin route takes the pool lease the controllers take, so restarts asked for by
hand and rolled out by the loop never have two engines of a cluster out at once."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from engine_sidecar.sim.adaptive import attach_controller, default_settings
from engine_sidecar.sim.config import SimEngineConfig
from engine_sidecar.sim.engine import ReconfigureRefused, SimEngine
from engine_sidecar.sim.speculation import SimSpecConfig
from engine_sidecar.speculation import schedule as sch

from .conftest import FAST, Start, parse_sse

SCHEDULE = "num_speculative_tokens_per_batch_size"
SPEC = SimSpecConfig.build(restart_s=20.0)  # 0.1 s of wall time at FAST


def _config() -> SimEngineConfig:
    return SimEngineConfig(num_speculative_tokens=4, spec=SPEC, time_scale=FAST)


async def _out(engine: SimEngine) -> None:
    async with asyncio.timeout(5):
        while not engine.restarting:  # noqa: ASYNC110 (polls the engine's flag)
            await asyncio.sleep(0.001)


async def _back(engine: SimEngine) -> None:
    async with asyncio.timeout(5):
        while engine.draining or engine.restarting:  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def _stream(http: aiohttp.ClientSession, url: str) -> list[object]:
    body = {"prompt": "speculate " * 8, "max_tokens": 20, "ignore_eos": True, "stream": True}
    async with asyncio.timeout(5), http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        return parse_sse(await resp.read())


async def test_a_second_reconfigure_during_the_first_is_refused(
        start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(_config())
    engine, url = cluster.engines[0], cluster.urls[0]
    first = asyncio.create_task(engine.reconfigure(sch.uniform(2, 256)))
    await _out(engine)
    with pytest.raises(ReconfigureRefused, match="already"):
        await engine.reconfigure(sch.uniform(3, 256))
    await first
    assert engine.schedule == sch.uniform(2, 256) and engine.restarts == 1
    assert not engine.draining and not engine.restarting
    events = await asyncio.gather(*(_stream(http, url) for _ in range(4)))
    assert all(e[-1] == "[DONE]" for e in events)  # admitted after the restart, all served


async def test_a_controller_rollout_during_an_admin_restart_is_held(
        start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(_config(), _config())
    (a, b), (url_a, _) = cluster.engines, cluster.urls
    ctl_a, ctl_b = (attach_controller(e, default_settings(e), cluster.spec_lease) for e in (a, b))
    async with http.post(url_a + "/admin/speculation", json={SCHEDULE: [[1, 256, 2]]}) as resp:
        assert resp.status == 202
    await _out(a)
    # Neither the other engine of the pool nor this one's own controller may go now.
    assert not await ctl_b.apply_now(sch.uniform(3, 256))
    assert "another engine of the pool" in ctl_b.last_hold
    assert not await ctl_a.apply_now(sch.uniform(3, 256))
    assert not b.draining and b.restarts == 0
    await _back(a)
    assert a.schedule == sch.uniform(2, 256) and a.restarts == 1
    assert cluster.spec_lease.holders == set()
    assert await ctl_b.apply_now(sch.uniform(3, 256))  # the lease is free again


async def test_an_admin_restart_during_a_controller_rollout_is_refused(
        start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(_config(), _config())
    (a, b), (_, url_b) = cluster.engines, cluster.urls
    ctl_a = attach_controller(a, default_settings(a), cluster.spec_lease)
    rollout = asyncio.create_task(ctl_a.apply_now(sch.uniform(2, 256)))
    await _out(a)
    async with http.post(url_b + "/admin/speculation", json={SCHEDULE: [[1, 256, 3]]}) as resp:
        assert resp.status == 409
        assert "another engine of the pool" in (await resp.json())["error"]["message"]
    assert not b.draining and b.restarts == 0
    assert await rollout
    async with http.post(url_b + "/admin/speculation", json={SCHEDULE: [[1, 256, 3]]}) as resp:
        assert resp.status == 202
    await _back(b)
    assert b.restarts == 1
