"""Engine behaviour seen through HTTP: prefix caching, KV usage, queueing, priority, preemption,
speculative decoding, aborts and draining."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import aiohttp
import pytest

from engine_sidecar.sim.cluster import start_cluster
from engine_sidecar.sim.config import SimEngineConfig
from engine_sidecar.sim.engine import SimEngine

from .conftest import Start, chat_body, metric, parse_sse


async def wait_for(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                   **extra: object) -> dict[str, object]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, object] = await resp.json()
        return data


async def test_prefix_cache_hits_on_repeated_prompt_only(start: Start,
                                                         http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url = cluster.urls[0]
    long_prompt = "A long shared system prompt about routing. " * 50  # 2150 bytes, 538 tokens
    await complete(http, url, long_prompt, 2)
    hits_first = await metric(http, url, "vllm:prefix_cache_hits_total")
    await complete(http, url, long_prompt, 2)
    hits_second = await metric(http, url, "vllm:prefix_cache_hits_total")
    assert hits_first == 0
    assert hits_second == (538 - 1) // 16 * 16
    await complete(http, url, "Different words entirely, nothing shared. " * 50, 2)
    assert await metric(http, url, "vllm:prefix_cache_hits_total") == hits_second
    queries = await metric(http, url, "vllm:prefix_cache_queries_total")
    assert queries >= 3 * 500


async def test_kv_usage_rises_with_concurrent_long_requests_then_falls(
        start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(num_gpu_blocks=400, time_scale=10)
    url, engine = cluster.urls[0], cluster.engines[0]
    responses = []
    for i in range(4):
        body = {"prompt": f"request {i} " + "x" * 4000, "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        resp = await http.post(url + "/v1/completions", json=body)
        await resp.content.readuntil(b"\n\n")  # first token: the prompt is in the cache
        responses.append(resp)
    assert await metric(http, url, "vllm:kv_cache_usage_perc") > 0.55  # 4 x 63 of 400 blocks
    for resp in responses:
        assert parse_sse(await resp.read())[-1] == "[DONE]"
        resp.release()
    await wait_for(lambda: engine.num_running == 0)
    assert await metric(http, url, "vllm:kv_cache_usage_perc") == 0.0


async def test_requests_queue_beyond_max_num_seqs(start: Start,
                                                  http: aiohttp.ClientSession) -> None:
    cluster = await start(max_num_seqs=2, time_scale=10)
    url, engine = cluster.urls[0], cluster.engines[0]
    tasks = [asyncio.create_task(complete(http, url, f"q{i}", 5000)) for i in range(5)]
    await wait_for(lambda: engine.num_running == 2 and engine.num_waiting == 3)
    assert await metric(http, url, "vllm:num_requests_running") == 2
    assert await metric(http, url, "vllm:num_requests_waiting") == 3
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await wait_for(lambda: engine.num_running == engine.num_waiting == 0)


async def test_priority_scheduling_runs_lower_values_first(start: Start,
                                                           http: aiohttp.ClientSession) -> None:
    cluster = await start(max_num_seqs=1, scheduling_policy="priority", time_scale=10)
    url, engine = cluster.urls[0], cluster.engines[0]
    blocker = asyncio.create_task(complete(http, url, "blocker", 5000))
    await wait_for(lambda: engine.num_running == 1)
    order: list[int] = []

    async def one(priority: int) -> None:
        await complete(http, url, f"p{priority}", 2, priority=priority)
        order.append(priority)

    tasks: list[asyncio.Task[None]] = []
    for priority in (5, -1, 3, 0):
        tasks.append(asyncio.create_task(one(priority)))
        queued = len(tasks)
        await wait_for(lambda: engine.num_waiting == queued)  # noqa: B023 (awaited at once)
    blocker.cancel()  # frees the only slot: the queue now drains in priority order
    await asyncio.gather(blocker, return_exceptions=True)
    await asyncio.gather(*tasks)
    assert order == [-1, 0, 3, 5]


async def test_preemption_under_a_tiny_cache(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(num_gpu_blocks=12, block_size=16, max_num_seqs=8, time_scale=50)
    url = cluster.urls[0]
    results = await asyncio.gather(
        *(complete(http, url, f"prompt number {i} " * 8, 60) for i in range(4)))
    assert all(r["usage"]["completion_tokens"] == 60 for r in results)  # type: ignore[index]
    assert await metric(http, url, "vllm:num_preemptions_total") > 0
    assert cluster.engines[0].kv_usage == 0.0


async def test_speculative_decoding_counters_and_fewer_steps(start: Start,
                                                             http: aiohttp.ClientSession) -> None:
    cluster = await start(num_speculative_tokens=3, acceptance=(1.0, 1.0, 0.0))
    url = cluster.urls[0]
    body = {"prompt": "speculate", "max_tokens": 30, "ignore_eos": True, "stream": True}
    async with http.post(url + "/v1/completions", json=body) as resp:
        chunks = parse_sse(await resp.read())[:-1]
    assert len(chunks) < 30
    drafts = await metric(http, url, "vllm:spec_decode_num_drafts_total")
    accepted = await metric(http, url, "vllm:spec_decode_num_accepted_tokens_total")
    pos = [await metric(http, url, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        f'position="{p}"') for p in range(3)]
    assert drafts > 0
    assert await metric(http, url, "vllm:spec_decode_num_draft_tokens_total") >= drafts
    assert pos[2] == 0
    assert pos[0] >= pos[1] > 0
    assert accepted == sum(pos)
    assert await metric(http, url, "vllm:generation_tokens_total") == 30


async def test_client_disconnect_aborts_and_frees_blocks(start: Start,
                                                         http: aiohttp.ClientSession) -> None:
    cluster = await start(time_scale=10)
    url, engine = cluster.urls[0], cluster.engines[0]
    body = chat_body("a long answer please " * 20, max_tokens=2000, stream=True)
    resp = await http.post(url + "/v1/chat/completions", json=body,
                           headers={"X-Request-Id": "gone-1"})
    await resp.content.readuntil(b"\n\n")
    await resp.content.readuntil(b"\n\n")
    assert engine.kv_usage > 0
    resp.close()
    await wait_for(lambda: "chatcmpl-gone-1" in engine.aborted_ids)
    await wait_for(lambda: engine.num_running == 0 and engine.kv_usage == 0.0)
    async with http.get(url + "/admin/state") as state_resp:
        state = await state_resp.json()
    assert "chatcmpl-gone-1" in state["aborted_ids"]
    assert "gone-1" in state["aborted_request_ids"]
    assert await metric(http, url, "vllm:request_success_total", 'finished_reason="abort"') == 1


async def test_non_streaming_disconnect_aborts(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(time_scale=10)
    url, engine = cluster.urls[0], cluster.engines[0]
    task = asyncio.create_task(complete(http, url, "slow", 2000))
    await wait_for(lambda: engine.num_running == 1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_for(lambda: len(engine.aborted_ids) == 1 and engine.num_running == 0)


async def test_legacy_kv_metric_name(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(legacy_kv_metric=True)
    async with http.get(cluster.urls[0] + "/metrics") as resp:
        text = await resp.text()
    assert "vllm:gpu_cache_usage_perc{" in text
    assert "vllm:kv_cache_usage_perc" not in text
    assert 'vllm:cache_config_info{engine="0",model_name="sim-model",block_size="16"' in text


async def test_draining_refuses_new_requests(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(time_scale=10)
    url = cluster.urls[0]
    running = asyncio.create_task(complete(http, url, "in flight", 30))
    engine: SimEngine = cluster.engines[0]
    await wait_for(lambda: engine.num_running == 1)
    cluster.start_draining()
    async with http.post(url + "/v1/chat/completions", json=chat_body("late")) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == 503
    assert await metric(http, url, "kvproxy_sidecar_draining") == 1
    assert await metric(http, url, "kvproxy_sidecar_ready") == 0
    async with http.get(url + "/health") as resp:
        assert resp.status == 200
    assert await cluster.drain(timeout_s=10)
    result = await running
    assert result["usage"]["completion_tokens"] == 30  # type: ignore[index]


async def test_engine_shutdown_ends_open_streams_with_an_error(
        start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(time_scale=1)
    body = chat_body("never finishes", max_tokens=5000, stream=True)
    async with http.post(cluster.urls[0] + "/v1/chat/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")
        closing = asyncio.create_task(cluster.close())
        events = parse_sse(await resp.read())
    await closing
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == 503


async def test_fixed_port_gives_consecutive_ports(http: aiohttp.ClientSession) -> None:
    for _ in range(5):  # another process may hold the port after ours; try a few bases
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base > 65000:
            continue
        try:
            cluster = await start_cluster([SimEngineConfig(), SimEngineConfig(name="named")],
                                          host="127.0.0.1", port=base)
        except OSError:
            continue
        try:
            assert cluster.ports == [base, base + 1]
            assert [e.name for e in cluster.engines] == [f"sim-{base}", "named"]
            async with http.get(cluster.urls[1] + "/health") as resp:
                assert resp.headers["X-Engine-Id"] == "named"
        finally:
            await cluster.close()
        return
    pytest.skip("no two consecutive free ports found")
