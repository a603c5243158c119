"""compose.yaml: the GPU stack is wired as documented, the observability files it mounts are valid,
and the ``sim`` profile's services, run as plain processes, become healthy and serve a streamed
request through the proxy."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio
import yaml
from tiers import missing

from deploy.compose_runner import ROOT, LocalStack, services_for, start_order

COMPOSE = ROOT / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_gpu_stack_reserves_gpus_and_waits_for_health(compose: dict[str, Any]) -> None:
    gpu = services_for(compose, "gpu")
    assert {"redis", "draft", "target", "proxy"} <= set(gpu)
    for name in ("draft", "target"):
        svc = gpu[name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert "/ready" in " ".join(svc["healthcheck"]["test"])
        assert any(str(v).startswith("model-cache:") for v in svc["volumes"])
        assert any(k.endswith("_MODEL") for k in svc["environment"])
        assert svc["command"][:2] == ["kvproxy-sidecar", "vllm"]
    deps = gpu["proxy"]["depends_on"]
    assert all(deps[d]["condition"] == "service_healthy" for d in ("redis", "draft", "target"))
    assert "model-cache" in compose["volumes"]


def test_profiles_and_dockerfiles(compose: dict[str, Any]) -> None:
    sim = services_for(compose, "sim")
    assert not {"draft", "target", "proxy"} & set(sim), "the sim stack needs no GPU service"
    assert {"prometheus", "grafana"} <= set(services_for(compose, "observability"))
    for svc in compose["services"].values():
        build = svc.get("build")
        if build:
            assert (ROOT / build["context"] / build["dockerfile"]).is_file()
        for vol in svc.get("volumes", []):
            src = str(vol).split(":")[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), src
    for profile in ("profiles/draft.toml", "profiles/target.toml"):
        assert (ROOT / profile).is_file()


def test_prometheus_alerts_and_dashboard_are_valid() -> None:
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"] for job in prom["scrape_configs"]}
    assert {"kvproxy", "engines"} <= jobs
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    for name in ("EngineKVCacheNearlyFull", "EngineQueueBuilding", "ProxySheddingLoad",
                 "ProxySlowTimeToFirstToken", "SpeculativeAcceptanceLow",
                 "PrefixCacheHitRateLow"):
        assert alerts[name]["expr"].strip()
    dash = json.loads((ROOT / "deploy/grafana/dashboards/kvproxy.json").read_text())
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("kv-cache usage", "queue", "time to first token", "shed rate",
                  "acceptance rate", "cache hit rate"):
        assert topic in titles, topic
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    assert "kvproxy_engine_kv_usage" in exprs and "vllm:prefix_cache_hits_total" in exprs


@pytest.fixture
def sim_stack(compose: dict[str, Any], tmp_path: Path) -> Iterator[LocalStack]:
    if shutil.which("redis-server") is None:
        missing("redis-server is not installed")
    stack = LocalStack(compose, "sim", tmp_path)
    stack.plan_ports()
    try:
        for name in start_order(stack.services):
            stack.start(name)
            stack.wait_healthy(name)
        yield stack
    finally:
        stack.stop_all()


async def test_sim_profile_runs_and_streams_through_the_proxy(sim_stack: LocalStack) -> None:
    assert set(sim_stack.running) == {"redis", "sim-draft", "sim-target", "proxy-sim"}
    proxy = f"http://127.0.0.1:{sim_stack.local_port('proxy-sim', 8000)}"
    async with aiohttp.ClientSession() as s:
        for model in ("target", "draft", "chat"):
            body = {"model": model, "stream": True, "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hello from compose"}]}
            async with s.post(proxy + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                raw = (await resp.read()).decode()
            assert raw.rstrip().endswith("data: [DONE]")
            assert '"chat.completion.chunk"' in raw
        async with s.get(proxy + "/metrics") as resp:
            assert resp.status == 200
            metrics = await resp.text()
    assert "kvproxy_" in metrics
    # The proxy keeps its shared state in the stack's Redis: it holds a connection there and has
    # seen no Redis errors.
    assert not re.search(r"^kvproxy_redis_errors_total\S* [1-9]", metrics, re.M)
    client = redis.asyncio.Redis(port=sim_stack.local_port("redis", 6379))
    try:
        info = await client.info("clients")
    finally:
        await client.aclose()
    assert info["connected_clients"] >= 2, info  # this client and the proxy
