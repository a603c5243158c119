"""The floor references of the overhead benchmark: named, launched and judged like the routers."""

from pathlib import Path

from bench.peers import Router, _floor, all_routers, parse_router_list
from bench.targets import cpu_targets


def test_floor_references_are_named_only_explicitly():
    assert parse_router_list("floor/*") == [Router("floor", "aiohttp"),
                                            Router("floor", "aiohttp-splice")]
    assert all(r.router != "floor" for r in all_routers())  # never part of "every router"
    assert Router("floor", "aiohttp").unavailable() is None


def test_floor_command_lines(tmp_path: Path):
    argv, _, ready, _ = _floor(Router("floor", "aiohttp-splice"), ["http://a", "http://b"], "m",
                               1234, tmp_path)
    assert argv[1:] == ["-m", "bench.floor", "--port", "1234", "--engines", "http://a,http://b",
                        "--splice"]
    assert ready == "http://127.0.0.1:1234/health"
    argv, _, _, _ = _floor(Router("floor", "aiohttp"), ["http://a"], "m", 1234, tmp_path)
    assert "--splice" not in argv


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
