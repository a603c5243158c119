"""Several simulated engines in one process, each on its own port.

Rules: ``start_cluster`` binds every engine before it returns (so ``urls`` are live) and starts each
engine's step loop; ``SimCluster.close`` refuses new requests, stops the step loops (aborting what
still runs, so open streams end at once) and then the servers; it is idempotent. Port 0 gives every
engine its own free port; a port ``P`` gives ``P, P+1, ...``. An engine without a configured name
is called ``sim-<port>``. The engines of a cluster are one pool for speculation restarts: they share
``spec_lease`` (the admin route and the controllers take it), so one is out at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiohttp import web

from engine_sidecar.sim.config import SimEngineConfig
from engine_sidecar.sim.engine import SimEngine
from engine_sidecar.sim.server import build_app
from engine_sidecar.speculation.lease import LocalLease


@dataclass
class SimCluster:
    engines: list[SimEngine]
    urls: list[str]
    spec_lease: LocalLease = field(default_factory=LocalLease)
    _runners: list[web.AppRunner] = field(default_factory=list, repr=False)
    _closed: bool = False

    @property
    def ports(self) -> list[int]:
        return [int(url.rsplit(":", 1)[1]) for url in self.urls]

    def start_draining(self) -> None:
        """Refuse new requests on every engine (503) and report draining in ``/metrics``."""
        for engine in self.engines:
            engine.draining = True

    @property
    def in_flight(self) -> int:
        return sum(engine.in_flight for engine in self.engines)

    async def drain(self, timeout_s: float) -> bool:
        """Start draining and wait up to ``timeout_s`` for in-flight requests; True if all ended."""
        self.start_draining()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:  # noqa: ASYNC110 (polls plain counters)
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.start_draining()
        for engine in self.engines:
            await engine.close()
        for runner in self._runners:
            await runner.cleanup()

    async def __aenter__(self) -> SimCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _start_one(config: SimEngineConfig, host: str, port: int, lease: LocalLease
                     ) -> tuple[SimEngine, web.AppRunner, int]:
    engine = SimEngine(config)
    # Handlers are cancelled when their client leaves (that is how a disconnect aborts); at
    # shutdown only injected delays can still be running, so they get little time.
    runner = web.AppRunner(build_app(engine, lease), handler_cancellation=True, access_log=None,
                           shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        bound = int(runner.addresses[0][1])
        engine.name = config.name or f"sim-{bound}"
        engine.start()  # binds the KV-event sockets too, which can fail (a port in use)
    except BaseException:
        await engine.close()
        await runner.cleanup()
        raise
    return engine, runner, bound


async def start_cluster(configs: Sequence[SimEngineConfig], host: str = "127.0.0.1",
                        port: int = 0) -> SimCluster:
    """Start one engine per config; see the module rules for ports and names."""
    cluster = SimCluster(engines=[], urls=[])
    url_host = f"[{host}]" if ":" in host else host
    try:
        for i, config in enumerate(configs):
            engine, runner, bound = await _start_one(config, host, port + i if port else 0,
                                                     cluster.spec_lease)
            cluster.engines.append(engine)
            cluster._runners.append(runner)
            cluster.urls.append(f"http://{url_host}:{bound}")
    except BaseException:
        await cluster.close()
        raise
    return cluster
