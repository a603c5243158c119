"""Benchmark: speculative-first routing against the target pool alone, on simulated engines.

``python -m bench.specfirst`` starts, in one process on a virtual clock (``bench.vclock``), a draft
pool (one simulated Llama-3.2-1B on an L4, ``llama1b-l4``), a target pool (one simulated
Llama-3.1-70B FP8 on an H100, ``llama70b-h100``) and a real kvproxy in front of them, and sends
the same workload twice per agreement level: to the target model directly (target-only) and to a
``speculative_first`` alias. The workload mixes two tenants: ``easy`` (the draft agrees with the
target's greedy token with probability level + 0.05) and ``hard`` (level - 0.05); requests arrive
as a Poisson process, greedy, streamed, with prompts of ~200 tokens and natural answers of
32..192 tokens.

At the highest level a third arm verifies through ``prompt_logprobs`` on ``/v1/completions``
(``verify = "prompt_logprobs"``), which vLLM computes without reading its prefix cache, instead
of the default cache-reading token-in endpoint.

Measured per arm: the share of output tokens written by the draft, target GPU-seconds per 1k
output tokens (the target engine's own busy time, ``/admin/state`` ``busy_s``, over the tokens
delivered), TTFT and end-to-end p50/p90. The virtual clock counts engine time only: the proxy's
own CPU time per request is not in the latencies (it is reported separately, in wall seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import vclock
from bench.stats import percentile
from engine_sidecar.sim.cluster import start_cluster
from engine_sidecar.sim.config import SimEngineConfig
from proxy.core.config import Config, PressureConfig, ServerConfig, TelemetryConfig
from proxy.core.door_config import AuthConfig, TenantConfig
from proxy.core.fleet_config import AliasConfig, EngineConfig, PoolConfig
from proxy.server.lifecycle import ProxyServer

RESULTS = Path(__file__).resolve().parent / "results"
TARGET, DRAFT, ALIAS = "llama-70b", "llama-1b", "llama-sf"
LEVELS = (0.9, 0.6, 0.3)
WORDS = ("cache", "route", "token", "engine", "prefix", "tenant", "block", "queue", "answer")


@dataclass
class Arm:
    level: float
    speculative: bool
    verify: str = "cached"  # the alias's verification transport (AliasConfig.verify)
    window: float | None = None  # the alias's verify_window_s (None: its default)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: int = 0
    draft_tokens: int = 0
    target_busy_s: float = 0.0
    draft_busy_s: float = 0.0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    fallback_requests: int = 0
    wall_s: float = 0.0

    def row(self) -> dict[str, Any]:
        return {
            "agreement": self.level, "arm": self._name(), "requests": len(self.e2e),
            "failed": self.failed,
            "output_tokens": self.tokens,
            "draft_share": round(self.draft_tokens / max(1, self.tokens), 3),
            "target_gpu_s_per_1k": round(1000 * self.target_busy_s / max(1, self.tokens), 3),
            "draft_gpu_s_per_1k": round(1000 * self.draft_busy_s / max(1, self.tokens), 3),
            "ttft_p50": round(percentile(self.ttft, 50), 3),
            "ttft_p90": round(percentile(self.ttft, 90), 3),
            "e2e_p50": round(percentile(self.e2e, 50), 3),
            "e2e_p90": round(percentile(self.e2e, 90), 3),
            "target_only_requests": self.fallback_requests,
            "proxy_wall_s": round(self.wall_s, 1), "errors": sorted(set(self.errors))[:5],
        }


    def _name(self) -> str:
        if not self.speculative:
            return "target_only"
        name = "speculative_first" + ("" if self.verify == "cached" else f"/{self.verify}")
        return name + ("" if self.window is None else f"/window={self.window:g}")


def _engines(level: float, time_scale: float) -> list[SimEngineConfig]:
    common: dict[str, Any] = {"time_scale": time_scale, "stop_len_range": (32, 192),
                              "max_model_len": 4096}
    by_class = (("easy", min(1.0, level + 0.05)), ("hard", max(0.0, level - 0.05)))
    return [
        SimEngineConfig(model=TARGET, name="h100-0", profile="llama70b-h100", **common),
        SimEngineConfig(model=DRAFT, name="l4-0", profile="llama1b-l4",
                        draft_agreement=level, draft_agreement_by_workload=by_class, **common),
    ]


def _config(urls: Sequence[str], verify: str = "cached", window: float | None = None
            ) -> Config:
    pools = (PoolConfig("target", TARGET, (EngineConfig("h100-0", urls[0]),)),
             PoolConfig("draft", DRAFT, (EngineConfig("l4-0", urls[1]),)))
    alias = AliasConfig(ALIAS, mode="speculative_first", draft="draft", target="target",
                        chunk=16, fallback_retry_s=30.0, verify=verify)
    if window is not None:
        alias = dataclasses.replace(alias, verify_window_s=window)
    tenants = tuple(TenantConfig(name, (f"key-{name}-000",)) for name in ("easy", "hard"))
    return Config(server=ServerConfig(host="127.0.0.1", port=0),
                  auth=AuthConfig(tenants=tenants),
                  # Both arms unguarded: the guard's answer-length prior (512 tokens) would shed
                  # target-only traffic that speculative legs (not booked as commitments) avoid.
                  pressure=PressureConfig(enabled=False),
                  telemetry=TelemetryConfig(interval_s=0.5, timeout_s=0.4, stale_after_s=2.0),
                  pools=pools, aliases=(alias,))


def _prompt(rng: random.Random, i: int) -> str:
    return f"Request {i}. " + " ".join(rng.choice(WORDS) for _ in range(160))


async def _one(http: aiohttp.ClientSession, url: str, arm: Arm, body: dict[str, Any],
               tenant: str) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    first: float | None = None
    headers = {"X-Workload-Class": tenant, "Authorization": f"Bearer key-{tenant}-000"}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            arm.failed += 1
            arm.errors.append(f"{resp.status} {(await resp.read())[:200]!r}")
            return
        if resp.headers.get("X-Speculative", "").startswith("target-only"):
            arm.fallback_requests += 1
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line \
                    and b'"content":""' not in line:
                first = loop.time()
            elif line.startswith(b": kvproxy draft_tokens="):
                arm.draft_tokens += int(line.split(b"=")[1].split()[0])
            elif line.startswith(b"data: {") and b'"usage"' in line:
                arm.tokens += orjson.loads(line[6:])["usage"]["completion_tokens"]
    end = loop.time()
    arm.ttft.append((first or end) - start)
    arm.e2e.append(end - start)


async def _busy(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/admin/state") as resp:
        return float((await resp.json())["busy_s"])


async def run_arm(arm: Arm, requests: int, rate: float, seed: int) -> Arm:
    cluster = await start_cluster(_engines(arm.level, 1.0), port=0)
    server = ProxyServer(_config(cluster.urls, arm.verify, arm.window))
    await server.start()
    rng = random.Random(seed)
    wall = time.perf_counter()
    try:
        async with aiohttp.ClientSession() as http:
            tasks = []
            for i in range(requests):
                tenant = "easy" if rng.random() < 0.5 else "hard"
                body = {"model": ALIAS if arm.speculative else TARGET, "temperature": 0,
                        "messages": [{"role": "user", "content": _prompt(rng, i)}],
                        "max_tokens": 256, "stream": True,
                        "stream_options": {"include_usage": True}}
                tasks.append(asyncio.create_task(_one(http, server.url, arm, body, tenant)))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
            arm.target_busy_s = await _busy(http, cluster.urls[0])
            arm.draft_busy_s = await _busy(http, cluster.urls[1])
    finally:
        arm.wall_s = time.perf_counter() - wall
        await server.stop()
        await cluster.close()
    return arm


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--levels", type=float, nargs="*", default=list(LEVELS))
    parser.add_argument("--out", type=Path, default=RESULTS / "specfirst.json")
    parser.add_argument("--windows", type=float, nargs="*", default=[],
                        help="verify_window_s values to compare (replaces the default arms)")
    args = parser.parse_args(argv)
    rows = []
    for level in args.levels:
        arms = [Arm(level, False), Arm(level, True)]
        if args.windows:
            arms = [Arm(level, False), *(Arm(level, True, window=w) for w in args.windows)]
        elif level == max(args.levels):  # what verification costs without the prefix cache
            arms.append(Arm(level, True, "prompt_logprobs"))
        for arm in arms:
            rows.append(vclock.run(run_arm(arm, args.requests, args.rate, args.seed)).row())
            print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps({"settings": dataclasses.asdict(_Settings(
        args.requests, args.rate, args.seed)), "rows": rows}, indent=2) + "\n")
    return 0


@dataclass(frozen=True)
class _Settings:
    requests: int
    rate: float
    seed: int


if __name__ == "__main__":
    raise SystemExit(main())
