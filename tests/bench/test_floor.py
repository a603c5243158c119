"""The floor references of the overhead benchmark: named, launched and judged like the routers."""

import asyncio
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from bench import firehose, floor
from bench.peers import Router, _floor, all_routers, parse_router_list
from bench.targets import cpu_targets


def test_floor_references_are_named_only_explicitly():
    assert parse_router_list("floor/*") == [Router("floor", "aiohttp"),
                                            Router("floor", "aiohttp-splice"),
                                            Router("floor", "tcp")]
    assert all(r.router != "floor" for r in all_routers())  # never part of "every router"
    assert Router("floor", "aiohttp").unavailable() is None


def test_floor_command_lines(tmp_path: Path):
    argv, _, ready, _ = _floor(Router("floor", "aiohttp-splice"), ["http://a", "http://b"], "m",
                               1234, tmp_path)
    assert argv[1:] == ["-m", "bench.floor", "--port", "1234", "--engines", "http://a,http://b",
                        "--splice"]
    assert ready == "http://127.0.0.1:1234/health"
    argv, _, _, _ = _floor(Router("floor", "aiohttp"), ["http://a"], "m", 1234, tmp_path)
    assert "--splice" not in argv and "--tcp" not in argv
    argv, _, _, _ = _floor(Router("floor", "tcp"), ["http://a"], "m", 1234, tmp_path)
    assert argv[-1] == "--tcp"


def test_floor_references_are_judged_against_the_cpu_goals():
    fit = {"routers": {
        "floor/aiohttp": {"a_ms": 0.5, "b_us_per_token": 20.0, "a_net_ms": 0.5,
                          "b_net_us_per_token": 20.0},
        "vllm-router/round_robin": {"a_ms": 0.3, "b_us_per_token": 21.0, "a_net_ms": 0.3,
                                    "b_net_us_per_token": 21.0},
    }}
    text = cpu_targets(fit, {})
    assert "`floor/aiohttp` (raw): b 20.0 us ≤ vllm-router/round_robin's 21.0 us — **met**" in text
    assert "a 0.500 ms ≤ 2 x 0.300 ms — **met**" in text


def test_the_relay_goal_is_shown_beside_the_peers_own_rate():
    kv = {"paced": {"events_per_cpu_s": 90_000.0}}
    peer = {"paced": {"events_per_cpu_s": 120_000.0}}
    text = cpu_targets({}, kv, {"kvproxy/round_robin": kv, "vllm-router/round_robin": peer,
                                "floor/tcp": {"paced": {"error": "x"}}})
    assert "- relay, paced: 90000 events per proxy CPU-second ≥ 150000 — **not met**" in text
    assert ("`vllm-router/round_robin` in the same test: 120000 (it does not reach the goal); "
            "kvproxy ÷ `vllm-router/round_robin`: 0.75") in text
    assert "floor/tcp" not in text


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("splice", [False, True])
async def test_a_floor_relays_the_engines_bytes_as_they_are(splice: bool):
    """The instrument must relay what it measures: every byte of a stream, in order, both ways
    of relaying (the splice is kvproxy's own, so a change there must keep the floor working)."""
    source, source_url = await _serve(firehose.build_app())
    floor_runner, floor_url = await _serve(floor.build_app([source_url], splice))
    body = orjson.dumps({"model": "firehose", "max_tokens": 50, "stream": True})
    try:
        async with aiohttp.ClientSession() as session:
            direct = await _post(session, source_url, body)
            relayed = await _post(session, floor_url, body)
    finally:
        await floor_runner.cleanup()
        await source.cleanup()
    assert relayed == direct and relayed.count(b"data: ") == 52  # 50 tokens, usage, [DONE]


async def test_the_tcp_floor_relays_the_engines_bytes_as_they_are():
    """The TCP floor has no HTTP of its own: the client's request and the engine's answer pass
    through unchanged, a keep-alive connection's second request included."""
    source, source_url = await _serve(firehose.build_app())
    server = await floor.start_tcp("127.0.0.1", 0, [source_url])
    port = server.sockets[0].getsockname()[1]
    body = orjson.dumps({"model": "firehose", "max_tokens": 50, "stream": True})
    try:
        async with aiohttp.ClientSession() as session:
            direct = await _post(session, source_url, body)
            relayed = [await _post(session, f"http://127.0.0.1:{port}", body) for _ in range(2)]
    finally:
        server.close()
        await server.wait_closed()
        await source.cleanup()
    assert relayed == [direct, direct] and direct.count(b"data: ") == 52


async def _post(session: aiohttp.ClientSession, base: str, body: bytes) -> bytes:
    async with asyncio.timeout(10):
        resp = await session.post(base + "/v1/chat/completions", data=body)
        assert resp.status == 200
        return await resp.read()
