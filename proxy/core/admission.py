"""Admission: admit a request to a pool or shed it, by priority class and KV-cache pressure.

Rules:
- The KV figure compared with a class's threshold is that of the best engine the request could use:
  the lowest KV usage among the pool's routable, fresh engines.
- Thresholds have hysteresis per (pool, class): once shedding (KV above ``shed_above``) a class is
  admitted again only when KV falls below ``admit_below``, so decisions do not flap
  with each scrape.
- ``critical`` is shed only when no engine is routable at all (its default threshold is above 1.0).
- Stale telemetry never sheds on its own: when every routable engine is stale, critical and standard
  requests fail open (``Admit(stale_fail_open=True)``); sheddable requests are shed, reason
  ``telemetry_stale``.
- KV overcommit guard (``proxy.core.pressure``): an engine under pressure is closed to sheddable
  work, then to standard work too; never to critical work. Closed engines are left out of the KV
  figure and of ``eligible``; when every fresh engine of the pool is closed to the class, it is
  shed: ``preempting`` when any of them preempts, ``kv_pressure`` when KV usage is already past the
  class's threshold, ``kv_overcommit`` when its growth is projected to cross it, else
  ``kv_committed``; the caller may degrade it to the draft pool as for ``kv_pressure``.
- Commitments: an engine is also closed to a sheddable or standard request that would itself take
  the engine's committed KV (reported usage plus what the proxy's in-flight requests still owe) to
  the class's committed mark (``pressure.committed_sheddable`` / ``committed_standard``
  ``shed_above``; ``need_tokens``: its prompt plus its expected output). A request that alone
  reaches the mark (``kv_share``) could never pass it: it counts as just under the mark, so an
  engine with next to nothing committed (under ``EMPTY_KV``) takes it, and a busy one does not.
- Pure: no clock, no I/O. The only state is the per-(pool, class) shedding flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from proxy.core.config import AdmissionConfig, ClassThreshold, PressureConfig
from proxy.core.errors import BadRequest
from proxy.core.pressure import (
    REASON_COMMITTED,
    REASON_OVERCOMMIT,
    REASON_PREEMPTING,
    Level,
    Pressure,
)
from proxy.core.routing import EngineView

REASON_KV = "kv_pressure"
REASON_NO_ENGINE = "no_routable_engine"
REASON_STALE = "telemetry_stale"


class Priority(Enum):
    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"


_ENGINE_PRIORITY = {Priority.CRITICAL: -10, Priority.STANDARD: 0, Priority.SHEDDABLE: 10}


def _from_int(value: int) -> Priority:
    # vLLM semantics: lower runs first.
    if value < 0:
        return Priority.CRITICAL
    return Priority.STANDARD if value == 0 else Priority.SHEDDABLE


def _from_text(text: str) -> Priority | None:
    low = text.strip().lower()
    for p in Priority:
        if p.value == low:
            return p
    try:
        return _from_int(int(low))
    except ValueError:
        return None


def parse_priority(header: str | None, body_value: object) -> Priority:
    """The class from the ``X-Priority`` header, else the body's ``priority``; default standard."""
    if header is not None and header.strip():
        found = _from_text(header)
        if found is None:
            raise BadRequest(
                "X-Priority must be critical, standard, sheddable or an integer", param="priority"
            )
        return found
    if body_value is None:
        return Priority.STANDARD
    if isinstance(body_value, int) and not isinstance(body_value, bool):
        return _from_int(body_value)
    if isinstance(body_value, str) and (found := _from_text(body_value)) is not None:
        return found
    raise BadRequest(
        "priority must be an integer or one of critical, standard, sheddable", param="priority"
    )


# Committed KV under this share counts as an empty engine: it takes even a request that alone
# reaches a committed mark (``kv_share``).
EMPTY_KV = 0.01


def kv_share(need_tokens: float, capacity_tokens: float, mark: float) -> float:
    """The share of an engine's KV a request needing ``need_tokens`` counts for against
    ``mark``: its own, or, when that alone reaches the mark, just under it (``EMPTY_KV`` below):
    an oversized request waits for an empty engine instead of being refused for ever."""
    return min(need_tokens / capacity_tokens, max(0.0, mark - EMPTY_KV))


# The lowest pressure level that closes an engine to each class; critical is never closed by it.
_CLOSED_AT = {Priority.SHEDDABLE: Level.SHEDDABLE, Priority.STANDARD: Level.STANDARD}


def closed_to(pressure: Pressure, cls: Priority) -> bool:
    """Whether an engine under ``pressure`` takes no more ``cls`` work."""
    at = _CLOSED_AT.get(cls)
    return at is not None and pressure.level >= at


def engine_priority(p: Priority) -> int:
    """The ``priority`` written into the upstream body for engines with priority scheduling."""
    return _ENGINE_PRIORITY[p]


@dataclass(frozen=True)
class Admit:
    stale_fail_open: bool = False


@dataclass(frozen=True)
class Shed:
    reason: str
    retry_after_s: int


Decision = Admit | Shed


class Admission:
    """Admission decisions with hysteresis state per (pool, class)."""

    def __init__(self, cfg: AdmissionConfig, pressure: PressureConfig | None = None) -> None:
        self.cfg = cfg
        marks = pressure if pressure is not None else PressureConfig()
        self._committed_above = {Priority.SHEDDABLE: marks.committed_sheddable.shed_above,
                                 Priority.STANDARD: marks.committed_standard.shed_above}
        self._shedding: dict[tuple[str, Priority], bool] = {}

    def threshold(self, cls: Priority) -> ClassThreshold:
        if cls is Priority.CRITICAL:
            return self.cfg.critical
        return self.cfg.standard if cls is Priority.STANDARD else self.cfg.sheddable

    def shedding(self, pool: str, cls: Priority) -> bool:
        """Whether (pool, class) is currently in its shedding state."""
        return self._shedding.get((pool, cls), False)

    def closed(self, engine: EngineView, cls: Priority, need_tokens: float = 0.0) -> bool:
        """Whether ``engine`` takes no ``cls`` request needing ``need_tokens`` of KV: closed by the
        guard, or the request would take its committed KV to the class's committed mark."""
        p = engine.pressure
        if closed_to(p, cls):
            return True
        if cls is Priority.CRITICAL or p.committed_kv is None or not p.capacity_tokens:
            return False
        mark = self._committed_above[cls]
        return p.committed_kv + kv_share(need_tokens, p.capacity_tokens, mark) >= mark

    def decide(self, pool: str, cls: Priority, engines: Sequence[EngineView],
               need_tokens: float = 0.0) -> Decision:
        routable = [e for e in engines if e.routable]
        if not routable:
            return Shed(REASON_NO_ENGINE, self.cfg.retry_after_s)
        fresh = [e for e in routable if e.fresh]
        if not fresh:
            if cls is Priority.SHEDDABLE:
                return Shed(REASON_STALE, self.cfg.retry_after_s)
            return Admit(stale_fail_open=True)
        usable = [e for e in fresh if not self.closed(e, cls, need_tokens)]
        if not usable:
            return Shed(self._closed_reason(pool, cls, fresh), self.cfg.retry_after_s)
        best_kv = min(e.kv_usage for e in usable)
        if self._update(pool, cls, best_kv):
            return Shed(REASON_KV, self.cfg.retry_after_s)
        return Admit()

    def _closed_reason(self, pool: str, cls: Priority, fresh: Sequence[EngineView]) -> str:
        """Why a class every fresh engine is closed to is shed: preemptions first; then the KV
        threshold when usage is already past it (today's reason); else the projection."""
        if any(e.pressure.reason == REASON_PREEMPTING for e in fresh):
            return REASON_PREEMPTING
        if self._update(pool, cls, min(e.kv_usage for e in fresh)):
            return REASON_KV
        if any(e.pressure.reason == REASON_OVERCOMMIT for e in fresh):
            return REASON_OVERCOMMIT
        return REASON_COMMITTED

    def _update(self, pool: str, cls: Priority, kv: float) -> bool:
        """Move the hysteresis state for ``kv`` and return whether to shed."""
        limits = self.threshold(cls)
        shedding = self._shedding.get((pool, cls), False)
        if shedding and kv < limits.admit_below:
            shedding = False
        elif not shedding and kv > limits.shed_above:
            shedding = True
        self._shedding[(pool, cls)] = shedding
        return shedding

    def eligible(self, cls: Priority, engines: Sequence[EngineView],
                 need_tokens: float = 0.0) -> list[EngineView]:
        """The engines a request of ``cls`` should be routed among: fresh ones above the class's
        ``shed_above`` are left out (stale ones are kept, their KV figure is unknown), and so are
        those the overcommit guard closed to ``cls``. Never returns an empty list when ``engines``
        holds a routable engine: then all are returned."""
        limit = self.threshold(cls).shed_above
        keep = [e for e in engines
                if not (e.fresh and e.kv_usage > limit) and not self.closed(e, cls, need_tokens)]
        return keep if any(e.routable for e in keep) else list(engines)
