"""Outlier detection per pool (Envoy's model): eject an engine that fails where its pool succeeds.

The circuit breaker (``proxy.core.breaker``) counts first-byte timeouts as backpressure, on purpose:
a hot fleet must not be ejected engine by engine. That leaves an engine that answers its scrapes but
never its requests (hung) in the rotation. This detector catches it by comparing each engine with
the rest of its pool.

Rules:
- Fed one ``Result`` per engine exchange. Failures: a first-byte timeout, a connect failure, a 5xx
  other than 503, a stream or body broken off. Successes: an answer relayed whole. ``BUSY``
  (429/503) and ``NEUTRAL`` (a 4xx, a client gone) are neither: not counted, no streak broken.
- Outliers are relative to the pool: an engine is ejected only if, over the same period as the
  evidence against it, the rest of its pool worked: the other active engines' results since then
  number at least ``consecutive_failures`` and their median success rate (a median, so that a
  second broken engine does not hide the first) is at least ``min_pool_success_rate``. A pool
  whose engines all time out alike (a hot fleet) is never ejected, nor is one that has just
  turned hot (the others' failures since the streak began count, not their older successes).
- Two detectors. Consecutive: ``consecutive_failures`` failures in a row, judged against the
  pool's results since the first of them. Success rate (over each engine's recent results):
  among engines with at least ``success_rate_min_requests`` of them, when at least
  ``success_rate_min_engines`` have that many, one whose success rate is below
  ``mean - success_rate_stdev_factor * stdev``, below ``min_pool_success_rate``, and whose failure
  rate is at least twice the rest of the pool's over the same period (random failures spread
  over many engines always put one about two deviations low; only a real gap counts); evaluated
  at most every ``interval_s``.
- "Recent" is an engine's last ``window_requests`` results no older than ``window_s``.
- An ejection lasts ``base_ejection_s * times ejected``, at most ``max_ejection_s``; each
  ``max_ejection_s`` spent in service forgives one earlier ejection. At most
  ``max_ejection_percent`` of a pool is out at once (at least one engine, never the last one);
  engines on probation count as out.
- When its time is up an engine is on probation: one probe request at a time. The probe's success
  restores it (with a clean record), its failure ejects it again (for longer), a neutral result
  frees the probe slot.
- A result of an exchange sent before the engine's last ejection is ignored: it says nothing about
  the engine since then, and must not decide a probation.
- States move only along the transition table; any other move raises ``IllegalTransition``.
- Pure: no I/O, no clock (``now`` is passed to every call), deterministic.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from proxy.core.config import OutlierConfig


class OutlierState(Enum):
    ACTIVE = "active"
    EJECTED = "ejected"
    PROBATION = "probation"


class OutlierEvent(Enum):
    EJECT = "eject"  # an outlier, or its probe failed
    COOL = "cool"  # its ejection time is up
    RESTORE = "restore"  # its probe succeeded


class IllegalTransition(RuntimeError):
    """An event that the outlier transition table does not allow from the engine's state."""


TRANSITIONS: dict[tuple[OutlierState, OutlierEvent], OutlierState] = {
    (OutlierState.ACTIVE, OutlierEvent.EJECT): OutlierState.EJECTED,
    (OutlierState.EJECTED, OutlierEvent.COOL): OutlierState.PROBATION,
    (OutlierState.PROBATION, OutlierEvent.EJECT): OutlierState.EJECTED,
    (OutlierState.PROBATION, OutlierEvent.RESTORE): OutlierState.ACTIVE,
}


class Result(Enum):
    """What one exchange with an engine came to, as far as outliers go."""

    SUCCESS = "success"
    TIMEOUT = "timeout"  # no first byte (or whole answer) within its budget
    CONNECT = "connect"  # refused, reset or dropped before a response head
    ERROR = "error"  # a 5xx other than 503, or a stream / body broken off
    BUSY = "busy"  # 429 / 503: the engine is busy, not broken
    NEUTRAL = "neutral"  # a 4xx, or the client went away: says nothing about the engine


FAILURES = frozenset({Result.TIMEOUT, Result.CONNECT, Result.ERROR})

REASON_CONSECUTIVE = "consecutive_failures"
REASON_SUCCESS_RATE = "success_rate"
REASON_PROBE = "probe_failed"
# Rates equal but for float rounding (mean of equal values) are not below the mean.
_EPSILON = 1e-9
# A success-rate outlier fails at least this many times as often as the rest of its pool.
_FAILURE_RATIO = 2.0


@dataclass(frozen=True)
class Ejection:
    """One engine taken out of its pool: for metrics and logs."""

    pool: str
    engine: str
    reason: str
    duration_s: float
    times: int


@dataclass
class _Member:
    """One engine's record in its pool's detector."""

    state: OutlierState = OutlierState.ACTIVE
    streak: int = 0  # consecutive failures
    streak_since: float = 0.0  # when the first of them came back
    results: deque[tuple[float, bool]] = field(default_factory=deque)  # (when, succeeded)
    ok: int = 0  # successes in ``results``
    times: int = 0  # ejections, less those forgiven
    ejected_at: float = -math.inf
    until: float = 0.0
    returned_at: float = -math.inf
    probes: int = 0
    reason: str | None = None


class OutlierDetector:
    """The outlier detector of one pool."""

    def __init__(self, cfg: OutlierConfig, pool: str = "") -> None:
        self.cfg = cfg
        self.pool = pool
        self._members: dict[str, _Member] = {}
        self._next_eval = -math.inf

    # -- membership

    def add(self, engine: str) -> None:
        self._members.setdefault(engine, _Member())

    def remove(self, engine: str) -> None:
        """Forget an engine; its late results are ignored."""
        self._members.pop(engine, None)

    # -- queries

    def state(self, engine: str, now: float) -> OutlierState:
        member = self._members.get(engine)
        if member is None:
            return OutlierState.ACTIVE
        self._cool(member, now)
        return member.state

    def peek(self, engine: str, now: float) -> bool:
        """Whether a request may go to ``engine`` now; takes no probe slot (views call it)."""
        member = self._members.get(engine)
        if member is None or not self.cfg.enabled:
            return True
        self._cool(member, now)
        if member.state is OutlierState.PROBATION:
            return member.probes < 1
        return member.state is OutlierState.ACTIVE

    def allows(self, engine: str, now: float) -> bool:
        """Like ``peek``, for a request being dispatched: on probation it takes the probe slot,
        so ``record`` its result."""
        if not self.peek(engine, now):
            return False
        member = self._members.get(engine)
        if member is not None and member.state is OutlierState.PROBATION:
            member.probes += 1
        return True

    def ejected(self, now: float) -> int:
        """Engines out of the pool now (ejected or on probation)."""
        return sum(1 for name in self._members if self._out(name, now))

    def describe(self, engine: str, now: float) -> dict[str, Any]:
        """The engine's outlier record, for the admin view."""
        member = self._members.get(engine)
        if member is None:
            return {"state": OutlierState.ACTIVE.value, "ejections": 0}
        self._cool(member, now)
        row: dict[str, Any] = {"state": member.state.value, "ejections": member.times}
        if member.state is not OutlierState.ACTIVE:
            row["reason"] = member.reason
        if member.state is OutlierState.EJECTED:
            row["back_in_s"] = round(max(0.0, member.until - now), 3)
        return row

    # -- results

    def record(
        self, engine: str, result: Result, now: float, sent_at: float | None = None
    ) -> list[Ejection]:
        """The result of one exchange with ``engine``, sent at ``sent_at`` (None: just now).
        Returns the engines this result got ejected (it may be another one: success rate)."""
        member = self._members.get(engine)
        if member is None or not self.cfg.enabled:
            return []
        self._cool(member, now)
        if sent_at is not None and sent_at < member.ejected_at:
            return []  # from before its last ejection
        if result not in FAILURES and result is not Result.SUCCESS:
            if member.state is OutlierState.PROBATION:
                member.probes = max(0, member.probes - 1)
            return []
        failed = result in FAILURES
        if member.state is OutlierState.PROBATION:
            return self._probed(engine, member, failed, now)
        if member.state is OutlierState.EJECTED:
            return []
        self._remember(member, now, ok=not failed)
        out = self._streak(engine, member, failed, now)
        return out + self._success_rates(now)

    def _probed(self, engine: str, member: _Member, failed: bool, now: float) -> list[Ejection]:
        if failed:
            return [self._eject(engine, member, now, REASON_PROBE)]
        self._move(member, OutlierEvent.RESTORE)
        member.returned_at = now
        return []

    def _streak(self, engine: str, member: _Member, failed: bool, now: float) -> list[Ejection]:
        if not failed:
            member.streak = 0
            return []
        if member.streak == 0:
            member.streak_since = now
        member.streak += 1
        if member.streak < self.cfg.consecutive_failures:
            return []
        rest = self._rest_rate(engine, now, member.streak_since)
        if rest is None or rest < self.cfg.min_pool_success_rate or not self._room(now):
            return []
        return [self._eject(engine, member, now, REASON_CONSECUTIVE)]

    def _success_rates(self, now: float) -> list[Ejection]:
        if now < self._next_eval:
            return []
        self._next_eval = now + self.cfg.interval_s
        rates = self._rates(now)
        if len(rates) < self.cfg.success_rate_min_engines:
            return []
        spread = _threshold(list(rates.values()), self.cfg.success_rate_stdev_factor)
        threshold = min(spread - _EPSILON, self.cfg.min_pool_success_rate)
        out: list[Ejection] = []
        for name in sorted(rates, key=lambda n: (rates[n], n)):  # worst first
            member = self._members[name]
            if rates[name] >= threshold or not self._stands_out(name, rates[name], now):
                break
            out.append(self._eject(name, member, now, REASON_SUCCESS_RATE))
        return out

    def _stands_out(self, engine: str, rate: float, now: float) -> bool:
        since = self._members[engine].results[0][0]
        rest = self._rest_rate(engine, now, since)
        if rest is None or rest < self.cfg.min_pool_success_rate or not self._room(now):
            return False
        return 1.0 - rate >= _FAILURE_RATIO * (1.0 - rest)

    def _rates(self, now: float) -> dict[str, float]:
        """Success rates of the active engines with enough recent results."""
        rates: dict[str, float] = {}
        for name, member in self._members.items():
            if member.state is not OutlierState.ACTIVE:
                continue
            self._expire(member, now)
            if len(member.results) >= self.cfg.success_rate_min_requests:
                rates[name] = member.ok / len(member.results)
        return rates

    # -- rules

    def _room(self, now: float) -> bool:
        """Whether one more engine may go out without passing the cap (never the last one)."""
        n = len(self._members)
        allowed = min(n - 1, max(1, math.floor(n * self.cfg.max_ejection_percent / 100)))
        return self.ejected(now) < allowed

    def _rest_rate(self, engine: str, now: float, since: float) -> float | None:
        """The rest of the pool's success rate from ``since`` on: the median of the other active
        engines' rates, so that a second broken engine does not hide the first. None when they
        have fewer results than ``consecutive_failures`` between them to judge by."""
        rates: list[float] = []
        total = 0
        for name, member in self._members.items():
            if name == engine or member.state is not OutlierState.ACTIVE:
                continue
            self._expire(member, now)
            n, ok = _since(member, since)
            if n:
                rates.append(ok / n)
                total += n
        return statistics.median(rates) if total >= self.cfg.consecutive_failures else None

    def _out(self, engine: str, now: float) -> bool:
        return self.state(engine, now) is not OutlierState.ACTIVE

    # -- moves

    def _move(self, member: _Member, event: OutlierEvent) -> None:
        try:
            member.state = TRANSITIONS[(member.state, event)]
        except KeyError:
            raise IllegalTransition(f"{event.value} from {member.state.value}") from None
        member.probes = 0

    def _eject(self, engine: str, member: _Member, now: float, reason: str) -> Ejection:
        self._move(member, OutlierEvent.EJECT)
        cfg = self.cfg
        forgiven = 0
        if member.returned_at > -math.inf:
            forgiven = math.floor((now - member.returned_at) / cfg.max_ejection_s)
        member.times = max(0, member.times - forgiven) + 1
        duration = min(cfg.base_ejection_s * member.times, cfg.max_ejection_s)
        member.ejected_at, member.until, member.reason = now, now + duration, reason
        # A clean record for when it comes back: what it did before says nothing of then.
        member.streak = member.ok = 0
        member.results.clear()
        return Ejection(self.pool, engine, reason, duration, member.times)

    def _cool(self, member: _Member, now: float) -> None:
        if member.state is OutlierState.EJECTED and now >= member.until:
            self._move(member, OutlierEvent.COOL)

    def _remember(self, member: _Member, now: float, *, ok: bool) -> None:
        if len(member.results) >= self.cfg.window_requests:
            _, was_ok = member.results.popleft()
            member.ok -= was_ok
        member.results.append((now, ok))
        member.ok += ok
        self._expire(member, now)

    def _expire(self, member: _Member, now: float) -> None:
        horizon = now - self.cfg.window_s
        while member.results and member.results[0][0] < horizon:
            _, was_ok = member.results.popleft()
            member.ok -= was_ok


def _since(member: _Member, since: float) -> tuple[int, int]:
    """(results, successes) of ``member`` from ``since`` on."""
    n = ok = 0
    for when, succeeded in reversed(member.results):
        if when < since:
            break
        n += 1
        ok += succeeded
    return n, ok


def _threshold(rates: list[float], factor: float) -> float:
    """``mean - factor * stdev`` of the pool's success rates (population stdev, as Envoy)."""
    mean = sum(rates) / len(rates)
    variance = sum((r - mean) ** 2 for r in rates) / len(rates)
    return mean - factor * math.sqrt(variance)
