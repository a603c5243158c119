"""Speculation in the simulator: per-request acceptance and drift, vLLM's batch-size schedule,
the derived ``kvproxy_sidecar_spec_*`` series, and restarts with a new schedule (by hand over
``/admin/speculation``, and by the adaptive controller) that lose no request."""

from __future__ import annotations

import asyncio
import itertools
from array import array

import aiohttp
import pytest

from engine_sidecar.sim.adaptive import attach_controller
from engine_sidecar.sim.config import SimEngineConfig
from engine_sidecar.sim.engine import Sampling, SimEngine
from engine_sidecar.sim.speculation import SimSpecConfig, acceptance_for
from engine_sidecar.speculation.controller import ControllerSettings
from engine_sidecar.speculation.lease import LocalLease
from engine_sidecar.speculation.policy import PolicySettings
from engine_sidecar.speculation.schedule import ScheduleError, k_for_batch

from .conftest import FAST, Start, metric, parse_sse

SCHEDULE = "num_speculative_tokens_per_batch_size"


async def _stream(http: aiohttp.ClientSession, url: str, tokens: int = 40,
                  workload: str | None = None) -> list[object]:
    body = {"prompt": "speculate " * 8, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    headers = {"X-Workload-Class": workload} if workload else {}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        return parse_sse(await resp.read())


async def _stream_unless_draining(
        http: aiohttp.ClientSession, url: str, engine: object) -> list[object] | None:
    body = {"prompt": "speculate " * 8, "max_tokens": 30, "ignore_eos": True, "stream": True}
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status == 503 and getattr(engine, "draining", False):
            return None
        assert resp.status == 200
        return parse_sse(await resp.read())


async def _per_draft(http: aiohttp.ClientSession, url: str) -> float:
    drafts = await metric(http, url, "vllm:spec_decode_num_drafts_total")
    return await metric(http, url, "vllm:spec_decode_num_draft_tokens_total") / drafts


def test_acceptance_depends_on_the_class_and_drifts_at_a_time():
    spec = SimSpecConfig.build(classes={"code": (0.9,), "chat": (0.2, 0.1)},
                               drift=[(100.0, (0.3,))])
    assert acceptance_for(spec, (0.8,), None, 10.0, 3) == (0.8, 0.8, 0.8)
    assert acceptance_for(spec, (0.8,), None, 150.0, 3) == (0.3, 0.3, 0.3)
    assert acceptance_for(spec, (0.8,), "chat", 150.0, 3) == (0.2, 0.1, 0.1)
    assert acceptance_for(spec, (0.8,), "other", 10.0, 2) == (0.8, 0.8)
    with pytest.raises(ValueError, match=r"within 0\.\.1"):
        SimSpecConfig.build(classes={"x": (1.5,)})


def test_a_schedule_vllm_would_reject_is_refused_at_configuration():
    with pytest.raises(ScheduleError, match="overlap"):
        SimEngineConfig(num_speculative_tokens=4,
                        spec=SimSpecConfig.build(schedule=[[1, 8, 2], [4, 16, 1]]))
    with pytest.raises(ScheduleError, match="exceeds"):
        SimEngineConfig(num_speculative_tokens=2, spec=SimSpecConfig.build(schedule=[[1, 8, 3]]))


async def test_the_class_header_picks_the_acceptance(start: Start,
                                                     http: aiohttp.ClientSession) -> None:
    spec = SimSpecConfig.build(classes={"easy": (1.0,), "hard": (0.0,)})
    cluster = await start(SimEngineConfig(num_speculative_tokens=2, spec=spec, time_scale=FAST),
                          SimEngineConfig(num_speculative_tokens=2, spec=spec, time_scale=FAST))
    easy, hard = cluster.urls
    await _stream(http, easy, workload="easy")
    await _stream(http, hard, workload="hard")
    assert await metric(http, easy, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert await metric(http, hard, "vllm:spec_decode_num_accepted_tokens_total") == 0


async def test_batch_size_schedule_sets_the_draft_length(start: Start,
                                                          http: aiohttp.ClientSession) -> None:
    spec = SimSpecConfig.build(schedule=[[1, 1, 3], [2, 256, 1]])
    cluster = await start(SimEngineConfig(num_speculative_tokens=3, acceptance=(0.0,), spec=spec,
                                          time_scale=FAST))
    url = cluster.urls[0]
    await _stream(http, url)
    assert await _per_draft(http, url) == pytest.approx(3.0)  # alone: batch 1, K=3
    await asyncio.gather(*(_stream(http, url, 60) for _ in range(4)))
    assert await _per_draft(http, url) < 2.0  # mostly batch > 1, K=1


async def test_derived_spec_series_match_the_vllm_sidecars(start: Start,
                                                          http: aiohttp.ClientSession) -> None:
    """The sim exports the vLLM sidecar's derived series, and their values are the engine's: one
    conditional acceptance of 0.8 on K=3 accepts position i with probability 0.8^(i+1)."""
    cluster = await start(num_speculative_tokens=3, acceptance=(0.8,), time_scale=FAST)
    url = cluster.urls[0]
    await metric(http, url, "vllm:num_requests_running")  # the window's first sample: all zero
    await _stream(http, url, 1000)
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    for name in ("num_speculative_tokens 3", "window_drafts", "acceptance_rate",
                 "mean_acceptance_length", 'acceptance_per_position{position="2"}',
                 "best_num_speculative_tokens"):
        assert f"kvproxy_sidecar_spec_{name}" in text

    def value(name: str, label: str = "") -> float:
        """The sum of the samples of ``name`` (over the engine's labels) carrying ``label``."""
        found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.split("{", 1)[0].split(" ", 1)[0] == name and label in line]
        assert found, (name, label)
        return sum(found)

    spec = "kvproxy_sidecar_spec_"
    drafts = value("vllm:spec_decode_num_drafts_total")
    draft_tokens = value("vllm:spec_decode_num_draft_tokens_total")
    accepted = value("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"')
               for i in range(3)]
    derived = [value(spec + "acceptance_per_position", f'position="{i}"') for i in range(3)]
    # ~1000 tokens at ~2.95 a step: some 340 drafts, so a position's share is within 0.03 (one
    # standard deviation) of its probability; 0.1 is over 3 of them.
    assert drafts >= 250 and draft_tokens == 3 * drafts
    assert value(spec + "window_drafts") == drafts  # the window starts at zero
    expected = [0.8, 0.8 ** 2, 0.8 ** 3]
    assert derived == pytest.approx(expected, abs=0.1)
    assert value(spec + "acceptance_rate") == pytest.approx(sum(expected) / 3, abs=0.1)
    assert value(spec + "mean_acceptance_length") == pytest.approx(1 + sum(expected), abs=0.3)
    # And they are exactly what the engine's own counters say (what the vLLM sidecar derives).
    assert derived == pytest.approx([a / drafts for a in per_pos])
    assert value(spec + "acceptance_rate") == pytest.approx(accepted / draft_tokens)
    assert value(spec + "mean_acceptance_length") == pytest.approx(1 + accepted / drafts)
    assert accepted == pytest.approx(sum(per_pos))


async def test_admin_restart_drains_then_runs_the_new_schedule(
        start: Start, http: aiohttp.ClientSession) -> None:
    spec = SimSpecConfig.build(restart_s=5.0)
    cluster = await start(SimEngineConfig(num_speculative_tokens=3, acceptance=(0.0,), spec=spec,
                                          time_scale=FAST))
    url, engine = cluster.urls[0], cluster.engines[0]
    running = asyncio.create_task(_stream(http, url, 400))
    while not engine.num_running:  # noqa: ASYNC110 (waits for the stream to be admitted)
        await asyncio.sleep(0.001)
    async with http.post(url + "/admin/speculation", json={SCHEDULE: [[1, 4, 1], [5, 256, 0]]}
                         ) as resp:
        assert resp.status == 202
    assert "kvproxy_sidecar_draining" in (await http.get(url + "/metrics")).headers.get(
        "Content-Type", "") or engine.draining
    async with http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 503  # refused while it drains: the proxy routes elsewhere
    events = await running
    assert events[-1] == "[DONE]"  # the drain let it finish
    async with asyncio.timeout(10):
        while engine.restarts < 1 or engine.draining:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    async with http.get(url + "/admin/speculation") as resp:
        state = await resp.json()
    assert state[SCHEDULE] == [[1, 4, 1], [5, 256, 0]] and state["restarts"] == 1
    assert await metric(http, url, "vllm:spec_decode_num_drafts_total") == 0  # a new process
    await _stream(http, url)
    assert await _per_draft(http, url) == pytest.approx(1.0)


async def test_requests_for_a_restart_at_the_same_moment_restart_the_engine_once(
        start: Start, http: aiohttp.ClientSession) -> None:
    spec = SimSpecConfig.build(restart_s=2.0)
    cluster = await start(SimEngineConfig(num_speculative_tokens=3, spec=spec, time_scale=FAST))
    url, engine = cluster.urls[0], cluster.engines[0]

    async def ask(k: int) -> tuple[int, dict[str, object]]:
        async with http.post(url + "/admin/speculation", json={SCHEDULE: [[1, 256, k]]}) as r:
            return r.status, await r.json()

    answers = await asyncio.gather(*(ask(k) for k in (1, 2, 3)))
    assert sorted(status for status, _ in answers) == [202, 409, 409]
    assert all(body["error"]["type"] == "ConflictError" for status, body in answers  # type: ignore[index]
               if status == 409)
    async with asyncio.timeout(10):
        while engine.restarts < 1 or engine.draining or engine.restarting:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert engine.restarts == 1


async def test_a_failed_restart_keeps_the_old_schedule(start: Start,
                                                       http: aiohttp.ClientSession) -> None:
    cluster = await start(num_speculative_tokens=3, time_scale=FAST)
    engine = cluster.engines[0]
    engine.faults.update({"restart_fails": True})
    with pytest.raises(RuntimeError, match="failed to restart"):
        await engine.reconfigure(((1, 256, 1),))  # type: ignore[arg-type]
    assert engine.schedule is None and not engine.draining
    assert (await _stream(http, cluster.urls[0]))[-1] == "[DONE]"


async def test_the_controller_rolls_a_pool_one_engine_at_a_time(
        start: Start, http: aiohttp.ClientSession) -> None:
    spec = SimSpecConfig.build(restart_s=2.0)
    configs = [SimEngineConfig(name=f"e{i}", num_speculative_tokens=4, acceptance=(0.05,),
                               spec=spec, time_scale=FAST, seed=i) for i in range(2)]
    cluster = await start(*configs)
    lease = LocalLease(max_out=1)
    settings = ControllerSettings(
        policy=PolicySettings(max_k=4, max_batch=256, confirmations=1, min_interval_s=0,
                              min_drafts=5),
        poll_s=0.01, eval_s=0.05, window_s=0.5)
    controllers = [attach_controller(e, settings, lease) for e in cluster.engines]
    out_at_once = 0

    async def watch() -> None:
        nonlocal out_at_once
        while True:
            out_at_once = max(out_at_once, sum(e.draining for e in cluster.engines))
            await asyncio.sleep(0.001)

    tasks = [asyncio.create_task(c.run()) for c in controllers]
    watcher = asyncio.create_task(watch())
    try:
        async with asyncio.timeout(30):
            while sum(c.stats.reconfigurations["ok"] for c in controllers) < 2:
                open_engines = [(u, e) for u, e in zip(cluster.urls, cluster.engines, strict=True)
                                if not e.draining]
                results = await asyncio.gather(
                    *(_stream_unless_draining(http, u, e) for u, e in open_engines))
                # Every stream an engine accepted finished; a refusal is only ever a drain that
                # began after the engine was picked (a router would not have picked it then).
                assert all(r is None or r[-1] == "[DONE]" for r in results)
    finally:
        for t in (*tasks, watcher):
            t.cancel()
        await asyncio.gather(*tasks, watcher, return_exceptions=True)
    assert out_at_once == 1
    for e in cluster.engines:
        assert e.schedule is not None and k_for_batch(e.schedule, 2, 4) <= 1  # from 4
    text = controllers[0].metrics_text()
    assert 'kvproxy_sidecar_spec_reconfigurations_total{result="ok"} 1' in text
    assert 'kvproxy_sidecar_spec_schedule_k{range="2-4"} 4' not in text


@pytest.mark.parametrize(("schedule", "words"), [([[1, 4, 2], [3, 8, 1]], "overlap"),
                                                 ([[1, 8, 9]], "exceeds")])
async def test_admin_restart_refuses_a_bad_schedule(start: Start, http: aiohttp.ClientSession,
                                                    schedule: list[list[int]], words: str) -> None:
    cluster = await start(num_speculative_tokens=3, time_scale=FAST)
    url = cluster.urls[0]
    async with http.post(url + "/admin/speculation", json={SCHEDULE: schedule}) as resp:
        assert resp.status == 400
        assert words in (await resp.json())["error"]["message"]
    assert cluster.engines[0].restarts == 0 and not cluster.engines[0].draining


async def test_a_change_held_for_the_pools_lease_goes_at_the_next_poll_once_it_is_free() -> None:
    engine = SimEngine(SimEngineConfig(name="e0", num_speculative_tokens=4, acceptance=(0.05,),
                                       spec=SimSpecConfig.build(restart_s=0.0),
                                       time_scale=FAST, seed=3))
    engine.start()
    lease = LocalLease(max_out=1)
    assert await lease.acquire("another engine")
    # An evaluation interval far longer than the test: only the retry can make it decide again.
    settings = ControllerSettings(
        policy=PolicySettings(max_k=4, max_batch=256, confirmations=1, min_interval_s=0,
                              min_drafts=5),
        poll_s=0.01, eval_s=3600.0, window_s=60.0)
    controller = attach_controller(engine, settings, lease)

    async def load() -> None:
        for n in itertools.count():
            stream = engine.submit(f"r{n}", array("I", range(1000, 1064)),
                                   Sampling(max_tokens=20, ignore_eos=True, seed=n))
            while await stream.next_words():
                pass

    loader = asyncio.create_task(load())
    try:
        async with asyncio.timeout(30):
            for polls in itertools.count(1):
                await asyncio.sleep(0.01)
                await controller.step()  # a poll (the first one also evaluates, on nothing)
                if controller.stats.decisions["held"]:
                    break
                if polls % 5 == 0:
                    await controller.evaluate(asyncio.get_running_loop().time())
            loader.cancel()
            await lease.release("another engine")
            await controller.step()
        assert controller.stats.reconfigurations["ok"] == 1
        assert engine.schedule is not None and k_for_batch(engine.schedule, 1, 4) <= 1
    finally:
        loader.cancel()
        await engine.close()
