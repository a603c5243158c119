"""The control loop's thin async shell: observe, decide (``policy``), roll out (``rollout``).

Rules:
- Every ``poll_s`` the engine's metrics feed the window and the shift test (``shift``) reads it;
  every ``eval_s`` the policy decides, and at once when the test finds that acceptance moved (the
  window is then cut at the change point). After a change held only because another engine of
  the pool holds the lease, it decides again at every poll until it gets the lease: the other
  engine is back within one rollout, and a wait of up to ``eval_s`` after that would keep this
  one on the schedule it meant to leave. Every decision is logged (logger
  ``kvproxy.speculation``) with its inputs, and counted.
- How long a rollout kept the engine out (drain, restart, warm-up; for a failed one, until it is
  back on the last good schedule) is measured and is what the policy charges the next change for.
- After a rollout the policy starts again from ``committed`` with the decision rolled out, so a
  provisional change (made on positions the window had not measured) keeps its one follow-up.
- A change is rolled out only when ``act`` is on, the gate allows it and the pool lease is held:
  the engine handle drains, restarts with the new schedule and warms up; if that fails, the handle
  is asked to come back on the last good schedule. The lease is released once the engine is back:
  after a rollback that failed too, the engine is still out (the supervisor's backoff restarts
  it), so the lease stays held, and no rollout of this engine starts, until a poll finds it ready.
- A handle may abandon a reconfiguration without stopping the engine (its drain did not end in
  time: cutting the streams would lose requests) or because the sidecar is stopping: nothing is
  rolled back, the engine keeps its schedule (``abandoned``).
- The gate's queue is the window's mean (an operator's request before the first evaluation
  included), or one scrape's when the window has too few polls.
- The clock is the event loop's, so a virtual-time loop (the benchmark) runs the same code.
- Nothing here knows whether the engine is real vLLM or the simulator: that is the handle's job.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from engine_sidecar.speculation import schedule as sch
from engine_sidecar.speculation.cost import StepCost, calibrate
from engine_sidecar.speculation.export import render
from engine_sidecar.speculation.lease import Lease
from engine_sidecar.speculation.policy import (
    Decision,
    PolicySettings,
    PolicyState,
    committed,
    decide,
)
from engine_sidecar.speculation.rollout import Rollout, RolloutState, may_start
from engine_sidecar.speculation.shift import Shift, ShiftSettings, change_point
from engine_sidecar.speculation.window import (
    ImplausibleMetrics,
    MetricsWindow,
    WindowFigures,
    snapshot_from_text,
)

log = logging.getLogger("kvproxy.speculation")


class ReconfigureFailed(Exception):
    """The engine did not come back ready with the requested schedule."""


class ReconfigureAbandoned(Exception):
    """The engine was not restarted (its drain did not end in time, the sidecar is stopping, or
    another restart of it runs): it keeps the schedule it had, there is nothing to roll back."""


class EngineHandle(Protocol):
    def current_schedule(self) -> sch.Schedule:
        """The schedule the engine last came up ready with (not one still starting)."""
        ...

    async def metrics_text(self) -> str | None:
        """The engine's metrics; None while it is not ready (down, draining, starting)."""
        ...

    async def reconfigure(self, schedule: sch.Schedule, on_drained: Callable[[], None]
                          ) -> None:
        """Drain, call ``on_drained``, restart with ``schedule``, warm up; raises
        :class:`ReconfigureFailed` or :class:`ReconfigureAbandoned`."""
        ...


@dataclass(frozen=True)
class ControllerSettings:
    policy: PolicySettings
    act: bool = True  # False: decide and export, never restart (observe-only)
    poll_s: float = 2.0
    eval_s: float = 30.0
    window_s: float = 120.0
    # Hold a rollout while the engine's mean queue over the window is above this: a few requests
    # always wait for the next step, a backlog means the others could not take this one's share.
    max_waiting: float = 16.0
    shift: ShiftSettings = field(default_factory=ShiftSettings)

    def __post_init__(self) -> None:
        if min(self.poll_s, self.eval_s, self.window_s) <= 0:
            raise ValueError("poll_s, eval_s and window_s must be > 0")


@dataclass
class ControllerStats:
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("change", "keep", "wait", "held"), 0))
    reconfigurations: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("ok", "rolled_back", "failed", "abandoned"), 0))
    last: Decision | None = None
    last_change_gain: float | None = None
    measured_gain: float | None = None
    rate_before: float | None = None
    shifts: int = 0
    out_s: float | None = None  # how long the last rollout kept the engine out


ShedProbe = Callable[[], Awaitable[float | None]]
WaitingProbe = Callable[[], Awaitable[float]]


class Controller:
    def __init__(self, name: str, engine: EngineHandle, settings: ControllerSettings,
                 lease: Lease, *, cost: StepCost | None = None,
                 shed_probe: ShedProbe | None = None,
                 pool_waiting: WaitingProbe | None = None) -> None:
        self.name, self.engine, self.settings, self.lease = name, engine, settings, lease
        self.cost = cost or StepCost()
        self.window = MetricsWindow(settings.window_s)
        self.state = PolicyState()
        self.rollout = Rollout()
        self.stats = ControllerStats()
        self._shed_probe, self._pool_waiting = shed_probe, pool_waiting
        self._last_eval = -1e18
        self.last_hold = ""
        self._latest: WindowFigures | None = None
        self._shift_pending = False
        self._lease_retry = False  # the last change waited only for the pool's lease
        self._applying = False  # a rollout of this engine runs (``_apply``): one at a time
        self._distrusted = False  # the last scrape held an implausible value (logged once)
        self._out_since = 0.0  # when the rollout that left the engine ``failed`` began
        self._why = ""  # why the last rollout did not apply its schedule

    @property
    def max_k(self) -> int:
        return self.settings.policy.max_k

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:
                # The loop is an optimisation: a bug in it must never take the sidecar down.
                log.exception("speculation controller engine=%s: evaluation failed", self.name)
            await asyncio.sleep(self.settings.poll_s)

    async def step(self) -> Decision | None:
        """One poll, and one evaluation (with a rollout if it says so) when one is due."""
        now = self._now()
        text = await self.engine.metrics_text()
        if text is not None and self.rollout.state is RolloutState.FAILED and not self._applying:
            await self._back_after_failure(now)
        if text is not None:
            try:
                snapshot = snapshot_from_text(text, now)
            except ImplausibleMetrics as exc:
                # Skipped, not guessed around: the window keeps what it had (logged once a run).
                if not self._distrusted:
                    log.warning("speculation engine=%s: a scrape is not used: %s", self.name, exc)
                self._distrusted = True
            else:
                self._distrusted = False
                self.window.add(snapshot)
                if (shift := change_point(self.window.polls(), self.settings.shift)) is not None:
                    self._on_shift(shift)
        due = self._shift_pending or self._lease_retry
        if now - self._last_eval < self.settings.eval_s and not due:
            return None
        self._last_eval = now
        return await self.evaluate(now)

    def _on_shift(self, shift: Shift) -> None:
        log.info("speculation shift engine=%s: first-position acceptance %.3f -> %.3f "
                 "(statistic %.0f); deciding on the new regime only", self.name, shift.before,
                 shift.after, shift.statistic)
        self.window.cut(shift.index)
        self.stats.shifts += 1
        self._shift_pending = True

    async def evaluate(self, now: float) -> Decision | None:
        self._lease_retry = False
        current = self.engine.current_schedule()
        found = self.window.figures(current, self.max_k, self.settings.policy.max_batch)
        if found is None:
            return None
        self._latest = found
        self._calibrate(found, current)
        self._measure_gain(found)
        decision, self.state = decide(self.settings.policy, self.state, self.cost,
                                      found.figures, current=current, now=now,
                                      out_s=self.stats.out_s, shifted=self._shift_pending)
        if decision.ranges:  # the shift's evidence was enough to decide on
            self._shift_pending = False
        self._record(decision, found)
        if decision.action == "change" and self.settings.act:
            await self._apply(decision)
        return decision

    async def apply_now(self, schedule: sch.Schedule) -> bool:
        """Roll out ``schedule`` at once (an operator's request), through the same gate, lease
        and rollback; True when the engine runs it afterwards."""
        current = self.engine.current_schedule()
        return await self._apply(Decision("change", "requested", current, schedule, 0.0, ()))

    def _calibrate(self, found: WindowFigures, current: sch.Schedule) -> None:
        if found.prefill_per_token is not None and found.prefill_chunk is not None:
            self.cost = replace(self.cost, prefill_per_token=found.prefill_per_token,
                                prefill_chunk=found.prefill_chunk)
        if found.measured_itl_s is None:
            return
        self.cost = calibrate(self.cost, measured_itl_s=found.measured_itl_s,
                              batch_weights=found.figures.batch_weights,
                              k_of=lambda b: sch.k_for_batch(current, b, self.max_k),
                              per_position=found.figures.per_position)

    def _measure_gain(self, found: WindowFigures) -> None:
        before, now_rate = self.stats.rate_before, found.tokens_per_busy_second
        if before and now_rate and self.stats.last_change_gain is not None:
            self.stats.measured_gain = now_rate / before - 1

    def _record(self, decision: Decision, found: WindowFigures) -> None:
        self.stats.decisions[decision.action] += 1
        self.stats.last = decision
        inputs = {"per_position": [round(p, 3) for p in found.figures.per_position],
                  "drafts": found.figures.drafts, "load": round(found.load, 3),
                  "out_s": self.stats.out_s,
                  "batch_weights": dict(sorted(found.figures.batch_weights.items())),
                  "measured_itl_s": found.measured_itl_s,
                  "step_time_factor": {"off": self.cost.factor_off, "on": self.cost.factor_on},
                  "prefill": {"per_token": found.prefill_per_token,
                              "chunk": found.prefill_chunk},
                  "current": sch.render(decision.current),
                  "proposed": sch.render(decision.proposed)}
        log.info("speculation decision engine=%s %s", self.name,
                 json.dumps({**decision.as_log(), "inputs": inputs}, default=str))

    async def _apply(self, decision: Decision) -> bool:
        if self._applying:
            # One rollout of an engine at a time: a second (an operator's request, or the loop's
            # own decision, while one runs) would take the lease this engine already holds (it is
            # the same holder) and then release it while the first restart is still out.
            self._hold("a rollout of this engine is in progress")
            return False
        if self.rollout.state is RolloutState.FAILED:
            self._hold("the engine is not back from a failed rollback yet")
            return False
        self._applying = True
        try:
            return await self._apply_one(decision)
        finally:
            self._applying = False

    def _hold(self, why: str) -> None:
        log.info("speculation rollout held engine=%s: %s", self.name, why)
        self.stats.decisions["held"] += 1
        self.last_hold = why

    async def _queue(self) -> float:
        """The engine's queue for the gate: the window's mean, else what one scrape shows."""
        if self._pool_waiting is not None:
            return await self._pool_waiting()
        found = self.window.figures(self.engine.current_schedule(), self.max_k,
                                    self.settings.policy.max_batch)
        if found is not None:
            return found.waiting
        text = await self.engine.metrics_text()
        if text is None:
            return 0.0  # nothing is served, so nothing queues
        try:
            return snapshot_from_text(text, self._now()).waiting
        except ImplausibleMetrics:
            return 0.0

    async def _apply_one(self, decision: Decision) -> bool:
        waiting = await self._queue()
        shed = await self._shed_probe() if self._shed_probe else None
        ok, why = may_start(shed_increase=shed, pool_waiting=waiting,
                            max_waiting=self.settings.max_waiting)
        if not ok or not await self.lease.acquire(self.name):
            self._lease_retry = ok
            self._hold(why if not ok else "another engine of the pool is being reconfigured")
            return False
        try:
            outcome = await self._roll_out(decision)
        finally:
            # ``failed``: the engine is still out (down in the supervisor's backoff); the lease
            # goes when a poll finds it back (``_back_after_failure``).
            if self.rollout.state is not RolloutState.FAILED:
                await self.lease.release(self.name)
        self.state = committed(self.state, self._now(), decision if outcome == "ok" else None)
        self.last_hold = "" if outcome == "ok" else self._why
        return outcome == "ok"

    def _on_drained(self) -> None:
        if self.rollout.state is RolloutState.DRAINING:
            self.rollout.move(RolloutState.RESTARTING)

    async def _roll_out(self, decision: Decision) -> str:
        """Drain, restart, and roll back if that fails; the outcome, counted and logged."""
        good = decision.current
        self.rollout.move(RolloutState.LEASED)
        self.rollout.move(RolloutState.DRAINING)
        self.stats.rate_before = self._latest.tokens_per_busy_second if self._latest else None
        log.info("speculation rollout engine=%s: %s -> %s", self.name, sch.render(good),
                 sch.render(decision.proposed))
        started = self._now()
        try:
            await self.engine.reconfigure(decision.proposed, self._on_drained)
        except ReconfigureAbandoned as exc:
            return self._abandoned("rollout", exc)
        except ReconfigureFailed as exc:
            log.error("speculation rollout engine=%s failed (%s); rolling back to %s",
                      self.name, exc, sch.render(good))
            outcome = await self._roll_back(good)
            # A failed rollout kept the engine out too: charged, or the policy would think
            # restarts cheaper than they are.
            self.stats.out_s = self._now() - started
            self._out_since = started
            return outcome
        self.stats.out_s = self._now() - started
        self.rollout.move(RolloutState.IDLE)
        self.stats.reconfigurations["ok"] += 1
        self.stats.last_change_gain = decision.predicted_gain
        self.stats.measured_gain = None
        self.window.clear()
        return "ok"

    async def _roll_back(self, good: sch.Schedule) -> str:
        self.rollout.move(RolloutState.ROLLING_BACK)
        try:
            await self.engine.reconfigure(good, self._on_drained)
        except ReconfigureAbandoned as exc:
            return self._abandoned("rollback", exc)
        except ReconfigureFailed as exc:
            log.error("speculation rollback engine=%s failed too: %s", self.name, exc)
            self.rollout.move(RolloutState.FAILED)
            self.stats.reconfigurations["failed"] += 1
            self._why = ("the restart failed and so did the rollback; the supervisor restarts "
                         "the engine on the last good schedule")
            return "failed"
        self.rollout.move(RolloutState.IDLE)
        self.stats.reconfigurations["rolled_back"] += 1
        self.window.clear()
        self._why = "the restart failed; rolled back to the last good schedule"
        return "rolled_back"

    def _abandoned(self, what: str, exc: ReconfigureAbandoned) -> str:
        log.warning("speculation %s engine=%s abandoned: %s", what, self.name, exc)
        self.rollout.move(RolloutState.IDLE)
        self.stats.reconfigurations["abandoned"] += 1
        self._why = f"abandoned: {exc}"
        return "abandoned"

    async def _back_after_failure(self, now: float) -> None:
        """The supervisor brought the engine back after a failed rollback: it is in again."""
        self.rollout.move(RolloutState.IDLE)
        self.stats.out_s = now - self._out_since
        self.last_hold = ""
        log.info("speculation engine=%s back after a failed rollback (out %.1f s)", self.name,
                 self.stats.out_s)
        await self.lease.release(self.name)

    def metrics_text(self) -> str:
        return render(self)
