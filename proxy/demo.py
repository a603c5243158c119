"""``kvproxy demo``: the embedded default — the proxy plus a simulated fleet, in one process.

Rules: no Redis, no GPU, no configuration file. One draft engine (small-model profile) and two
target engines (70B-class profile, priority scheduling) run in this event loop on free ports; the
proxy serves pools ``draft`` and ``target`` and a tiering alias ``chat`` that sends sheddable work
to the draft pool when the targets run hot. Ctrl-C or SIGTERM drains and stops everything.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine_sidecar.sim.cluster import start_cluster
from engine_sidecar.sim.config import SimEngineConfig
from proxy.config import AliasConfig, Config, EngineConfig, PoolConfig, ServerConfig
from proxy.lifecycle import ProxyServer, run_server

DRAFT_MODEL = "llama-3.1-8b-instruct"
TARGET_MODEL = "llama-3.1-70b-instruct"
TIERING_ALIAS = "chat"
DRAFT_PROFILE = "llama8b-l4"
TARGET_PROFILE = "llama70b-h100"
DRAIN_TIMEOUT_S = 10.0


def engine_configs(time_scale: float) -> list[SimEngineConfig]:
    """The simulated fleet: ``draft-0``, then ``target-0`` and ``target-1``."""
    draft = SimEngineConfig(
        model=DRAFT_MODEL, name="draft-0", profile=DRAFT_PROFILE, time_scale=time_scale
    )
    targets = [
        SimEngineConfig(
            model=TARGET_MODEL,
            name=f"target-{i}",
            profile=TARGET_PROFILE,
            scheduling_policy="priority",
            time_scale=time_scale,
            seed=i,
        )
        for i in range(2)
    ]
    return [draft, *targets]


def demo_config(urls: Sequence[str], host: str, port: int) -> Config:
    """Proxy configuration for the fleet at ``urls`` (in ``engine_configs`` order)."""
    draft = PoolConfig("draft", DRAFT_MODEL, (EngineConfig("draft-0", urls[0]),))
    target = PoolConfig(
        "target",
        TARGET_MODEL,
        tuple(EngineConfig(f"target-{i}", url) for i, url in enumerate(urls[1:])),
        priority_scheduling=True,
    )
    return Config(
        server=ServerConfig(host=host, port=port, drain_timeout_s=DRAIN_TIMEOUT_S),
        pools=(draft, target),
        aliases=(AliasConfig(TIERING_ALIAS, "target", tiering=True),),
    )


def banner(server: ProxyServer) -> str:
    base = server.url
    lines = [
        f"kvproxy demo: proxy listening on {base}  (OpenAI base URL: {base}/v1)",
    ]
    for pool in server.cfg.pools:
        engines = ", ".join(f"{e.name} {e.url}" for e in pool.engines)
        lines.append(f"  pool {pool.name:<6} model {pool.model:<24} engines: {engines}")
    for alias in server.cfg.aliases:
        tiering = "; sheddable work falls back to draft under load" if alias.tiering else ""
        lines.append(f"  alias {alias.name!r} -> {alias.pool} pool{tiering}")
    lines += [
        f"  metrics {base}/metrics   engines {base}/admin/engines",
        "try:",
        f"  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f'    -d \'{{"model": "{TIERING_ALIAS}", "stream": true, "max_tokens": 32, '
        '"messages": [{"role": "user", "content": "Hello!"}]}\'',
        "Ctrl-C stops the demo.",
    ]
    return "\n".join(lines)


async def run_demo(*, host: str, port: int, time_scale: float) -> None:
    cluster = await start_cluster(engine_configs(time_scale), host="127.0.0.1", port=0)
    try:
        cfg = demo_config(cluster.urls, host, port)
        await run_server(cfg, on_started=_announce)
    finally:
        await cluster.close()


def _announce(server: ProxyServer) -> None:
    print(banner(server), flush=True, file=sys.stdout)
