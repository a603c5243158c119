"""Engine pressure (the KV overcommit guard's levels) shared between proxy replicas through Redis.

Rules:
- Every ``poll_s`` a replica writes, for each engine its own tracker closes, the key
  ``<prefix>pressure:<engine>:<level>`` (value: the reason and the replica) with a TTL of the
  guard's hold time, and reads every engine's keys in one MGET. A key of another replica's applies
  its level for two poll intervals, renewed on each read while the key lives, merged by maximum
  with the local level; only local judgements are written, so replicas never echo each other, and
  one key per level means a lower level never overwrites a higher one.
- The level is shared, not its bookkeeping: a replica's commitments (``proxy.core.commitment``) and
  telemetry stay its own; another replica sees only that the engine is closed, and why.
- Without Redis none of this runs. Redis trouble skips a round and never reaches a client.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import orjson

from proxy.core.jsondoc import json_object
from proxy.core.pressure import (
    REASON_COMMITTED,
    REASON_OVERCOMMIT,
    REASON_PREEMPTING,
    Level,
    PressureTracker,
)
from proxy.fleet.periodic import every
from proxy.tenancy.redis_link import RedisClient, RedisLink, RedisUnavailable


class HasPressure(Protocol):
    @property
    def name(self) -> str: ...

    pressure: PressureTracker | None


_LEVELS = (Level.SHEDDABLE, Level.STANDARD)
# A reason read from Redis is shown only if it is one of these.
_REASONS = (REASON_OVERCOMMIT, REASON_PREEMPTING, REASON_COMMITTED)


class SharedPressure:
    """Publishes this replica's engine pressure levels and applies the other replicas' ones."""

    def __init__(
        self,
        link: RedisLink,
        engines: Callable[[], Iterable[HasPressure]],
        *,
        hold_s: float,
        clock: Callable[[], float],
        poll_s: float = 0.25,
    ) -> None:
        self._link = link
        self._engines = engines
        # At least two polls, so a living judgement never lapses between two writes.
        self._ttl_ms = max(1, int(max(hold_s, 2 * poll_s) * 1000))
        self._clock = clock
        self.poll_s = poll_s
        self.replica = uuid.uuid4().hex[:12]
        self.published = 0
        self.applied = 0

    def _key(self, engine: str, level: Level) -> str:
        return self._link.key("pressure", engine, level.name.lower())

    async def sync(self) -> None:
        """One round: publish local levels, then apply remote ones."""
        engines = [e for e in self._engines() if e.pressure is not None]
        try:
            await self._publish(engines)
            await self._apply(engines)
        except RedisUnavailable:
            return

    async def _publish(self, engines: list[HasPressure]) -> None:
        now = self._clock()
        writes: list[tuple[str, bytes]] = []
        for engine in engines:
            assert engine.pressure is not None
            own = engine.pressure.local(now)
            if own.level > Level.OPEN:
                value = orjson.dumps({"reason": own.reason, "replica": self.replica})
                writes.append((self._key(engine.name, own.level), value))
        if not writes:
            return
        px = self._ttl_ms

        async def write(r: RedisClient) -> None:
            async with r.pipeline(transaction=False) as pipe:
                for key, value in writes:
                    pipe.set(key, value, px=px)
                await pipe.execute()

        await self._link.run("pressure_publish", write)
        self.published += len(writes)

    async def _apply(self, engines: list[HasPressure]) -> None:
        if not engines:
            return
        keys = [self._key(e.name, level) for e in engines for level in _LEVELS]
        values = await self._link.run("pressure_poll", lambda r: r.mget(keys))
        expires = self._clock() + 2 * self.poll_s
        for i, engine in enumerate(engines):
            assert engine.pressure is not None
            level, reason = self._remote(values[2 * i : 2 * i + 2])
            engine.pressure.apply_remote(level, reason, expires)
            self.applied += level > Level.OPEN

    def _remote(self, values: Sequence[object]) -> tuple[Level, str]:
        """The highest level another replica wrote among one engine's keys."""
        found, why = Level.OPEN, ""
        for level, raw in zip(_LEVELS, values, strict=True):
            doc = _decode(raw)
            if doc is not None and doc.get("replica") != self.replica:
                reason = doc.get("reason")
                found, why = level, reason if reason in _REASONS else REASON_OVERCOMMIT
        return found, why

    async def run(self) -> None:
        await every(self.poll_s, self.sync, "sharing engine pressure")


def _decode(raw: object) -> dict[str, object] | None:
    if not isinstance(raw, bytes) or len(raw) > 1024:
        return None
    return json_object(raw)
