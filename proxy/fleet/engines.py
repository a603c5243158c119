"""The engines this proxy knows: per engine its config, telemetry state, circuit breaker and its
pool's outlier detector.

Rules: this module only assembles pure-core objects and answers questions about them; it performs
no I/O and reads no clock (``now`` is always passed in). The scraper feeds telemetry into it, the
request path reads views from it and reports dispatches, settlements and exchange outcomes.
An engine is routable only when its health, its breaker and its pool's outlier detector all let
requests through; every engine of a pool shares that pool's detector.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.core.breaker import Breaker, BreakerState, Outcome
from proxy.core.commitment import Commitments, OutputEstimate, projected_usage
from proxy.core.config import Config, OutlierConfig
from proxy.core.costmodel import TYPICAL_PROMPT_TOKENS, expected_wait
from proxy.core.engine_state import EngineState, Health
from proxy.core.errors import ConfigError
from proxy.core.fleet_config import EngineConfig
from proxy.core.outlier import Ejection, OutlierDetector, Result
from proxy.core.pressure import NO_PRESSURE, Pressure, PressureTracker
from proxy.core.routing import EngineView
from proxy.observe.metrics import EngineGaugeRow
from proxy.observe.signals import PoolRow


@dataclass
class Engine:
    """One engine as the proxy sees it."""

    cfg: EngineConfig
    pool: str
    state: EngineState
    breaker: Breaker
    # Sent with every data-path request to this engine (its API key); never logged or shown.
    auth: dict[str, str] = field(default_factory=dict, repr=False)
    # Its pool's detector, shared by the pool's engines (the fleet binds it).
    outliers: OutlierDetector = field(
        default_factory=lambda: OutlierDetector(OutlierConfig()), repr=False
    )
    # The KV overcommit guard's judgement of this engine; None: the guard is off.
    pressure: PressureTracker | None = field(default=None, repr=False)
    # What this proxy's requests in flight here still owe the engine's KV cache, and the pool's
    # learned answer length (set by the fleet); None: commitments are not counted.
    commitments: Commitments = field(default_factory=Commitments, repr=False)
    estimate: OutputEstimate | None = field(default=None, repr=False)
    # The last snapshot fed to ``pressure`` (``judge_pressure``).
    _fed: object = field(default=None, repr=False, compare=False)
    # Bytes relayed per answered flight, as last looked at (``heard_since_last_look``).
    _looked: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def metrics_url(self) -> str:
        return self.cfg.metrics_url or self.cfg.url + "/metrics"

    def view(self, now: float) -> EngineView:
        # peek: a view must not take a half-open or probation probe slot; dispatch does that.
        return self.state.view(now, self._lets_through(now), self.judge_pressure(now))

    def judge_pressure(self, now: float) -> Pressure:
        """Feed the guard the latest snapshot (once each) and return the level in force."""
        guard = self.pressure
        if guard is None:
            return NO_PRESSURE
        snap = self.state.snapshot
        if snap is not None:
            # Asked for every engine of a pool on every admission: a snapshot already fed is
            # not offered again (the guard would ignore it: not newer than its last).
            if snap is not self._fed:
                self._fed = snap
                guard.observe(snap.taken_at, snap.kv_usage, snap.preemptions)
            guard.commit(*self.committed(now))
        return guard.pressure(now)

    def committed(self, now: float) -> tuple[float | None, int | None]:
        """(reported usage + what in-flight requests owe, capacity in tokens); None: unknown.
        The answered requests' part may be up to ``ANSWERED_REFRESH_S`` old (an upper bound:
        see ``proxy.core.commitment``)."""
        snap = self.state.snapshot
        if snap is None or self.estimate is None or not snap.block_size:
            return None, None
        blocks, size = snap.num_gpu_blocks, snap.block_size
        owed = self.commitments.owed_blocks(size, self.estimate.bytes_per_token, now)
        committed = projected_usage(snap.kv_usage, owed, size, blocks)
        return (None, None) if committed is None or blocks is None else (committed, size * blocks)

    def heard_since_last_look(self) -> bool:
        """Whether an open stream from the engine relayed more bytes since the last look (first
        bytes and whole answers date ``EngineState.answered_at`` themselves). Looked at when a
        scrape goes unanswered; the first failure after a successful scrape only takes its
        baseline, so an engine that hangs is not taken for alive on bytes older than its last
        snapshot."""
        relayed = self.commitments.relayed()
        seen = {} if self.state.consecutive_failures == 0 else self._looked
        self._looked = relayed
        return any(n > seen.get(t, n) for t, n in relayed.items())

    def _lets_through(self, now: float) -> bool:
        return self.breaker.peek(now) and self.outliers.peek(self.name, now)

    def allows(self, now: float) -> bool:
        """Whether a request may be dispatched to the engine now; takes the breaker's half-open
        and the detector's probation probe slot where they apply, so ``record`` its outcome."""
        if not self._lets_through(now):
            return False
        self.breaker.allows(now)
        self.outliers.allows(self.name, now)
        return True

    def full(self, limit: int) -> bool:
        """Whether this proxy already has ``limit`` requests open at the engine."""
        return self.state.open_requests >= limit

    def record(
        self,
        outcome: Outcome,
        now: float,
        result: Result | None = None,
        sent_at: float | None = None,
    ) -> list[Ejection]:
        """One exchange's outcome for the breaker and, as ``result`` (derived from ``outcome``
        when not given), for the outlier detector; returns the ejections it caused."""
        self.breaker.record(outcome, now)
        found = _RESULTS[outcome] if result is None else result
        return self.outliers.record(self.name, found, now, sent_at)


_RESULTS: dict[Outcome, Result] = {
    Outcome.SUCCESS: Result.SUCCESS,
    Outcome.FAILURE: Result.ERROR,
    Outcome.BACKPRESSURE: Result.BUSY,
    Outcome.CLIENT_ERROR: Result.NEUTRAL,
}


# Engines that left the fleet, kept for ``Fleet.get`` beyond those with requests still open.
_KEEP_REMOVED = 64


class Fleet:
    def __init__(self, cfg: Config, engines: Sequence[Engine] | None = None,
                 on_remove: Callable[[str, str], None] | None = None,
                 on_add: Callable[[str, str], None] | None = None) -> None:
        self._cfg = cfg
        self._removed: dict[str, Engine] = {}
        self._outliers: dict[str, OutlierDetector] = {}
        # Told (pool, engine name) when an engine leaves, so per-engine state elsewhere goes too.
        self._on_remove = on_remove
        self._on_add = on_add  # and when one joins at run time
        if engines is None:
            engines = [_engine(cfg, pool.name, e) for pool in cfg.pools for e in pool.engines]
        self._engines: dict[str, Engine] = {e.name: e for e in engines}
        self._pools: dict[str, list[Engine]] = {}
        self._estimates: dict[str, OutputEstimate] = {}
        for engine in engines:
            self._pools.setdefault(engine.pool, []).append(engine)
            self._bind(engine)

    def __iter__(self) -> Iterator[Engine]:
        return iter(self._engines.values())

    def add(self, pool: str, engine: EngineConfig) -> None:
        """Route to one more engine from now on (one discovered at run time, e.g. in Redis)."""
        if engine.name in self._engines:
            raise ValueError(f"engine {engine.name!r} is already in the fleet")
        added = _engine(self._cfg, pool, engine)
        self._removed.pop(added.name, None)
        self._engines[added.name] = added
        self._pools.setdefault(pool, []).append(added)
        self._bind(added)
        if self._on_add is not None:
            self._on_add(pool, added.name)

    def _bind(self, engine: Engine) -> None:
        detector = self._outliers.get(engine.pool)
        if detector is None:
            detector = self._outliers[engine.pool] = OutlierDetector(self._cfg.outlier, engine.pool)
        detector.add(engine.name)
        engine.outliers = detector
        if engine.pressure is not None and self._cfg.pressure.reserve_output:
            engine.estimate = self.estimate(engine.pool)

    def estimate(self, pool: str) -> OutputEstimate:
        """The pool's learned answer length (one per pool: its engines serve the same model)."""
        found = self._estimates.get(pool)
        if found is None:
            found = self._estimates[pool] = OutputEstimate(self._cfg.pressure)
        return found

    def remove(self, name: str) -> None:
        """Stop routing to an engine; requests already sent to it finish normally."""
        engine = self._engines.pop(name, None)
        if engine is not None:
            self._pools[engine.pool].remove(engine)
            engine.outliers.remove(name)
            # Kept for ``get`` (bookkeeping of requests sent before it left), bounded: the
            # latest leavers, and any with requests still open. Routing asks ``live``.
            self._removed[name] = engine
            if len(self._removed) > _KEEP_REMOVED:
                latest = list(self._removed)[-_KEEP_REMOVED:]
                self._removed = {n: e for n, e in self._removed.items()
                                 if n in latest or e.state.open_requests}
            if self._on_remove is not None:
                self._on_remove(engine.pool, name)

    def __len__(self) -> int:
        return len(self._engines)

    def get(self, name: str) -> Engine:
        """The engine by that name, also one that left the fleet lately (``KeyError`` else)."""
        engine = self._engines.get(name)
        return engine if engine is not None else self._removed[name]

    def live(self, name: str) -> Engine | None:
        """The engine by that name while it is in the fleet; None once it has left (a ranking
        made before an ``await`` may name one that has left since: it gets no new request)."""
        return self._engines.get(name)

    def pool(self, name: str) -> Sequence[Engine]:
        return self._pools.get(name, ())

    def views(self, pool: str, now: float) -> list[EngineView]:
        return [e.view(now) for e in self.pool(pool)]

    def tick(self, now: float, stale_after_s: float) -> None:
        for engine in self:
            engine.state.tick(now, stale_after_s)
            engine.judge_pressure(now)  # every snapshot, not only those a request happens to see

    def any_routable(self, now: float) -> bool:
        return any(e.view(now).routable for e in self)

    def admin_view(self, now: float) -> list[dict[str, Any]]:
        return [_admin_row(e, now) for e in self]

    def gauge_rows(self, now: float) -> list[EngineGaugeRow]:
        return [_gauge_row(e, now) for e in self]

    def pool_rows(self, now: float, typical: Mapping[str, float] | None = None) -> list[PoolRow]:
        """Each pool's autoscaling signals, from its fresh engines (``observe.signals``);
        ``typical``: each pool's typical prompt in tokens (for the expected wait)."""
        typical = typical or {}
        return [
            _pool_row(name, engines, now, typical.get(name, TYPICAL_PROMPT_TOKENS), self._cfg)
            for name, engines in self._pools.items()
        ]


def _pool_row(pool: str, engines: Sequence[Engine], now: float, typical: float,
              cfg: Config) -> PoolRow:
    waiting, kv = 0.0, []
    for engine in engines:
        state, snap = engine.state, engine.state.snapshot
        state.tick(now, state.stale_after_s)
        if snap is None or state.health is not Health.HEALTHY:
            continue
        waiting += snap.waiting + state.dispatched_since_snapshot + state.remote_pending
        kv.append(snap.kv_usage)
    wait = expected_wait([e.view(now) for e in engines], typical, cfg.routing)
    return PoolRow(pool, waiting, sum(kv) / len(kv) if kv else None, wait)


def _engine_path(cfg: Config, pool: str, name: str) -> str:
    """``pools[i].engines[j]``, as every other configuration error names an engine."""
    for i, found in enumerate(cfg.pools):
        for j, engine in enumerate(found.engines):
            if found.name == pool and engine.name == name:
                return f"pools[{i}].engines[{j}]"
    return f"pools.{pool}.engines.{name}"  # an engine not in the file (discovered at run time)


def _engine(cfg: Config, pool: str, engine: EngineConfig) -> Engine:
    auth: dict[str, str] = {}
    if engine.api_key_env is not None:
        key = os.environ.get(engine.api_key_env)
        if not key:
            where = _engine_path(cfg, pool, engine.name) + ".api_key_env"
            raise ConfigError(where, f"environment variable {engine.api_key_env} is not set")
        auth["Authorization"] = f"Bearer {key}"
    state = EngineState(
        engine.name,
        pool,
        engine.url,
        stale_after_s=cfg.telemetry.stale_after_s,
        unhealthy_after_failures=cfg.telemetry.unhealthy_after_failures,
    )
    return Engine(engine, pool, state, Breaker(cfg.breaker), auth=auth, pressure=_tracker(cfg))


def _tracker(cfg: Config) -> PressureTracker | None:
    if not cfg.pressure.enabled:
        return None
    return PressureTracker(cfg.pressure, sheddable=cfg.admission.sheddable,
                           standard=cfg.admission.standard, interval_s=cfg.telemetry.interval_s,
                           stale_after_s=cfg.telemetry.stale_after_s)


def _admin_row(engine: Engine, now: float) -> dict[str, Any]:
    state = engine.state
    snap = state.snapshot
    view = engine.view(now)
    return {
        "name": engine.name,
        "pool": engine.pool,
        "url": engine.cfg.url,
        "health": state.health.name.lower(),
        "health_reason": state.health_reason,
        "breaker": _breaker_name(engine.breaker.state),
        "outlier": engine.outliers.describe(engine.name, now),
        "routable": view.routable,
        "fresh": view.fresh,
        "load": view.load,
        "inflight": state.open_requests,
        # Reported by the other proxy processes sharing routing state (``proxy.core.sharing``).
        "inflight_other_proxies": state.remote_open,
        "completed": state.completed,
        "prefill_pending_tokens": view.prefill,
        "prefill_pending_requests": view.pending,
        "prefill_tokens_per_s": view.prefill_tps,
        "step_s": view.step_s,
        "dispatched_since_snapshot": state.dispatched_since_snapshot,
        "consecutive_scrape_failures": state.consecutive_failures,
        "last_error": state.last_error,
        "pressure": _pressure_dict(view.pressure),
        "snapshot_age_s": None if snap is None else round(max(0.0, now - snap.taken_at), 3),
        "snapshot": None if snap is None else _snapshot_dict(snap),
    }


def _gauge_row(engine: Engine, now: float) -> EngineGaugeRow:
    state = engine.state
    snap = state.snapshot
    return EngineGaugeRow(
        engine=engine.name,
        pool=engine.pool,
        kv_usage=None if snap is None else snap.kv_usage,
        running=None if snap is None else snap.running,
        waiting=None if snap is None else snap.waiting,
        snapshot_age_s=None if snap is None else state.snapshot_age(now),
        inflight=state.open_requests,
        breaker=_breaker_name(engine.breaker.state),
        health=state.health.name.lower(),
        outlier=engine.outliers.state(engine.name, now).value,
        pressure=int(engine.judge_pressure(now).level),
    )


def _pressure_dict(p: Pressure) -> dict[str, Any]:
    closed = {0: [], 1: ["sheddable"], 2: ["sheddable", "standard"]}[int(p.level)]
    return {"level": p.level.name.lower(), "closed_to": closed, "reason": p.reason,
            "projected_kv": p.projected_kv, "committed_kv": p.committed_kv,
            "preemptions_per_s": p.preemptions_per_s,
            "from_other_replica": p.remote}


def _snapshot_dict(snap: object) -> dict[str, Any]:
    fields = getattr(snap, "__dataclass_fields__", {})
    return {name: getattr(snap, name) for name in fields if name != "taken_at"}


def _breaker_name(state: BreakerState) -> str:
    return state.name.lower()


HEALTH_STATES: tuple[str, ...] = tuple(h.name.lower() for h in Health)
