"""The KV overcommit guard's levels shared across replicas through a real redis-server."""

from __future__ import annotations

import asyncio

from redisproc import SLOW_OK, RedisServer

from proxy.core.admission import Admission, Admit, Priority, Shed
from proxy.core.config import Config
from proxy.core.door_config import RedisConfig
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.pressure import Level
from proxy.core.telemetry import EngineSnapshot
from proxy.fleet.engines import Fleet
from proxy.tenancy.redis_link import RedisLink
from proxy.tenancy.shared_pressure import SharedPressure

POOL = PoolConfig("target", "m", (EngineConfig("e0", "http://127.0.0.1:9"),
                                  EngineConfig("e1", "http://127.0.0.1:10")))
CFG = Config(pools=(POOL,))
DT = CFG.telemetry.interval_s


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scrape(fleet: Fleet, name: str, at: float, kv: float, preemptions: float) -> None:
    snap = EngineSnapshot(taken_at=at, kv_usage=kv, running=1, waiting=0, preemptions=preemptions)
    fleet.get(name).state.on_scrape_ok(snap, at)
    fleet.tick(at, CFG.telemetry.stale_after_s)


def level(fleet: Fleet, name: str, now: float) -> Level:
    return fleet.get(name).judge_pressure(now).level


async def test_one_replicas_pressure_closes_the_engine_on_the_other(
    redis_server: RedisServer,
) -> None:
    clock = Clock()
    fleets = [Fleet(CFG), Fleet(CFG)]
    links = [RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK)) for _ in fleets]
    shared = [SharedPressure(lk, lambda f=f: f, hold_s=3.0, clock=clock, poll_s=0.25)
              for lk, f in zip(links, fleets, strict=True)]
    a, b = fleets
    try:
        # Replica A sees e1 start preempting; B, started later, sees the counter already at 4.
        for i, count in enumerate([0, 0, 4]):
            scrape(a, "e1", clock.now - (2 - i) * DT, 0.5, count)
        for name, count in (("e0", 0), ("e1", 4)):
            scrape(b, name, clock.now, 0.5, count)
        assert level(a, "e1", clock.now) is Level.SHEDDABLE
        for s in shared + shared:  # two rounds: nothing may echo back
            await s.sync()
        assert level(b, "e1", clock.now) is Level.SHEDDABLE
        pressure = b.get("e1").judge_pressure(clock.now)
        assert pressure.remote and pressure.reason == "preempting"
        assert level(b, "e0", clock.now) is Level.OPEN
        assert [s.published for s in shared] == [2, 0]  # A wrote its own level each round only
        assert b.get("e1").pressure.local(clock.now).level is Level.OPEN  # type: ignore[union-attr]

        adm = Admission(CFG.admission)
        views = b.views("target", clock.now)
        assert [v.name for v in adm.eligible(Priority.SHEDDABLE, views)] == ["e0"]

        # A escalates: both level keys exist; B takes the higher one.
        scrape(a, "e1", clock.now + DT, 0.5, 9)
        scrape(b, "e1", clock.now + DT, 0.5, 4)  # B's own scrape: a late view, no rise yet
        clock.now += DT
        for s in shared:
            await s.sync()
        assert level(b, "e1", clock.now) is Level.STANDARD
        only_e1 = [v for v in b.views("target", clock.now) if v.name == "e1"]
        assert adm.decide("target", Priority.STANDARD, only_e1) == Shed("preempting", 2)
        assert adm.decide("target", Priority.CRITICAL, only_e1) == Admit()
        ttl = await links[0].client.pttl(links[0].key("pressure", "e1", "standard"))
        assert 0 < ttl <= 3000  # the guard's hold

        # A stops judging (its telemetry went stale): the keys expire and B reopens the engine.
        clock.now += 5.0
        async with asyncio.timeout(15):
            while True:
                for s in shared:
                    await s.sync()
                if level(b, "e1", clock.now) is Level.OPEN:
                    break
                await asyncio.sleep(0.1)
        assert not await links[0].client.exists(links[0].key("pressure", "e1", "standard"))
    finally:
        for lk in links:
            await lk.close()


async def test_redis_down_keeps_local_judgement(redis_server: RedisServer) -> None:
    clock = Clock()
    fleet = Fleet(CFG)
    link = RedisLink(RedisConfig(url="redis://127.0.0.1:1", **SLOW_OK))
    shared = SharedPressure(link, lambda: fleet, hold_s=1.0, clock=clock)
    try:
        for i, count in enumerate([0, 0, 4]):
            scrape(fleet, "e0", clock.now - (2 - i) * DT, 0.5, count)
        await shared.sync()  # fails quietly
        assert level(fleet, "e0", clock.now) is Level.SHEDDABLE
        assert shared.published == 0
    finally:
        await link.close()
