"""``kvproxy demo``: the embedded default — the proxy plus a simulated fleet, on one machine.

Rules: no Redis, no GPU, no configuration file. One draft engine (small-model profile) and two
target engines (70B-class profile, priority scheduling) are started the way an operator starts
them, with the sidecar's command line (``python -m engine_sidecar sim``), in child processes on
free loopback ports; the proxy learns their URLs from what they print. The proxy serves pools
``draft`` and ``target`` and a tiering alias ``chat`` that sends sheddable work to the draft pool
when the targets run hot. Ctrl-C or SIGTERM drains the proxy, then stops the engines by their PIDs.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from collections.abc import AsyncIterator, Sequence

from proxy.core.config import Config, ServerConfig
from proxy.core.fleet_config import AliasConfig, EngineConfig, PoolConfig
from proxy.server.lifecycle import ProxyServer, run_server

DRAFT_MODEL = "llama-3.1-8b-instruct"
TARGET_MODEL = "llama-3.1-70b-instruct"
TIERING_ALIAS = "chat"
DRAFT_PROFILE = "llama8b-l4"
TARGET_PROFILE = "llama70b-h100"
DRAIN_TIMEOUT_S = 10.0
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
_SERVING = re.compile(r"engine (\S+) serving .* at (http://\S+)$")


def engine_commands(time_scale: float) -> list[list[str]]:
    """The simulated fleet as sidecar command lines: ``draft-0``, then ``target-0`` and
    ``target-1`` (one process for the targets, engine ``i`` seeded ``i``)."""
    common = [sys.executable, "-m", "engine_sidecar", "sim", "--host", "127.0.0.1", "--port", "0",
              "--time-scale", repr(time_scale), "--log-level", "INFO"]
    draft = [*common, "--name", "draft-0", "--model", DRAFT_MODEL, "--profile", DRAFT_PROFILE]
    targets = [*common, "--engines", "2", "--name", "target", "--model", TARGET_MODEL,
               "--profile", TARGET_PROFILE, "--scheduling-policy", "priority"]
    return [draft, targets]


@contextlib.asynccontextmanager
async def simulated_engines(time_scale: float) -> AsyncIterator[list[str]]:
    """Start the fleet; yields the engines' URLs in ``engine_commands`` order."""
    procs: list[asyncio.subprocess.Process] = []
    logs: list[asyncio.Task[None]] = []
    try:
        urls: list[str] = []
        for command, count in zip(engine_commands(time_scale), (1, 2), strict=True):
            proc = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
            )
            procs.append(proc)
            assert proc.stderr is not None
            urls += await asyncio.wait_for(_serving(proc.stderr, count), START_TIMEOUT_S)
            # From here on the engines' log flows to ours, as it would in a terminal.
            logs.append(asyncio.create_task(_forward(proc.stderr), name="kvproxy-demo-engine-log"))
        yield urls
    finally:
        for proc in procs:
            await _stop(proc)
        for task in logs:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _serving(log: asyncio.StreamReader, count: int) -> list[str]:
    """The URLs an engine process announces in its log."""
    urls: list[str] = []
    while len(urls) < count:
        line = await log.readline()
        if not line:
            raise RuntimeError("the simulated engines exited before serving")
        found = _SERVING.search(line.decode(errors="replace").strip())
        if found:
            urls.append(found.group(2))
    return urls


async def _forward(stream: asyncio.StreamReader) -> None:
    while line := await stream.readline():
        sys.stderr.write(line.decode(errors="replace"))


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def demo_config(urls: Sequence[str], host: str, port: int) -> Config:
    """Proxy configuration for the fleet at ``urls`` (in ``engine_commands`` order)."""
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
    async with simulated_engines(time_scale) as urls:
        await run_server(demo_config(urls, host, port), on_started=_announce)


def _announce(server: ProxyServer) -> None:
    print(banner(server), flush=True, file=sys.stdout)
