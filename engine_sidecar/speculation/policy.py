"""The goodput policy: which K each batch-size range should run, and whether a change pays.

Rules:
- For each batch-size range the best K (0 = off) maximises accepted tokens per second,
  ``b * (1 + sum(p[:K])) / step_time(b, K)``, averaged over the batch sizes the engine ran at
  inside the range (weighted by time); a range the engine never ran at is judged at its middle.
- Within ``tie`` of the best value the shortest draft is the best K: a difference that small is
  inside the model's error, and a shorter draft loses far less if acceptance falls (a long draft
  at a large batch is paid in FLOPs by every step whether or not its tokens are accepted).
- A proposal sets every range to its best K: the hysteresis is on the decision to restart (the
  engine-wide gain must beat the margin), not per range, since once the engine restarts anyway a
  range kept at a worse K only loses. The lowest range never drops below ``probe_k`` so that
  acceptance keeps being measured (vLLM counts nothing while nobody drafts).
- The engine-wide predicted gain is the ratio of the two schedules' throughput over the batch
  sizes seen. A change is proposed only when that gain exceeds the margin, the same proposal came
  out of ``confirmations`` evaluations in a row (or the shift test has already established that
  acceptance moved: that stands until a change is made or a decision keeps the schedule, so a
  change held for the pool's lease goes as soon as the lease is free), the last change is
  ``min_interval_s`` old, and the window holds at least ``min_drafts`` drafts (or acceptance is
  otherwise known).
- A change must also pay for its restart (:func:`required_gain`): while the engine is out (a
  measured or assumed ``out_s``) the rest of the pool carries its share, which is free while the
  pool has room and costs about the engine's whole output once it runs full. The gain over
  ``horizon_s`` must exceed that cost, so a change worth making at low load waits while the pool
  is busy, and is made when the load falls if it is still worth it.
- A change made on thin evidence is *provisional*: the new schedule drafts, at the batch sizes
  seen, positions the window had measured on fewer than ``followup_drafts`` drafts (after a
  shift, typically only position 1 was drafted, and the rest were extrapolated from it). Once
  the window has measured every position the new schedule drafts at those batch sizes on
  ``followup_drafts`` drafts, one follow-up evaluation may change it again with the smaller
  ``followup_margin``, without waiting for ``min_interval_s`` or the confirmations (the
  evidence is now direct; a landing a few per cent off the best would otherwise never be
  corrected). A follow-up is never provisional itself, so there is at most one per change.
- Per-position acceptance under a schedule that mixes draft lengths: a position ``i`` is only
  proposed in steps whose K exceeds ``i``, so its denominator is the drafts of those steps, which
  :func:`estimate_positions` infers from the batch sizes seen; unobserved positions repeat the last
  conditional rate.
- Pure: figures and the clock come in, a :class:`Decision` and the next state go out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from engine_sidecar.speculation.cost import StepCost, tokens_per_step
from engine_sidecar.speculation.schedule import Range, Schedule, from_edges, k_for_batch

DEFAULT_EDGES = (1, 2, 5, 9, 17, 33, 65)


@dataclass(frozen=True)
class PolicySettings:
    max_k: int
    max_batch: int
    edges: tuple[int, ...] = DEFAULT_EDGES
    margin: float = 0.05
    min_interval_s: float = 300.0
    confirmations: int = 2
    min_drafts: float = 50.0
    probe_k: int = 1
    tie: float = 0.01
    # A restart must pay for itself within this horizon (how long a measured regime is expected
    # to last); until a restart has been timed, one is assumed to keep the engine out this long.
    horizon_s: float = 600.0
    restart_cost_s: float = 60.0
    # Below this load the other engines of the pool absorb a restarting engine's share for free.
    spare_load: float = 0.5
    # The one re-evaluation after a provisional change (see the module rules).
    followup_margin: float = 0.02
    followup_drafts: float = 400.0

    def __post_init__(self) -> None:
        if self.max_k < 1 or self.max_batch < 1:
            raise ValueError("max_k and max_batch must be >= 1")
        if not self.edges or self.edges[0] != 1 or list(self.edges) != sorted(set(self.edges)):
            raise ValueError("edges must be increasing and start at 1")
        if self.margin < 0 or self.min_interval_s < 0 or self.confirmations < 1 \
                or not 0 <= self.tie < 1:
            raise ValueError("margin and min_interval_s must be >= 0, confirmations >= 1, "
                             "tie within 0..1")
        if not 0 <= self.probe_k <= self.max_k:
            raise ValueError("probe_k must be within 0..max_k")
        if self.horizon_s <= 0 or self.restart_cost_s < 0 or not 0 <= self.spare_load < 1:
            raise ValueError("horizon_s must be > 0, restart_cost_s >= 0, spare_load within "
                             "0..1 (excluding 1)")
        if self.followup_margin < 0 or self.followup_drafts <= 0:
            raise ValueError("followup_margin must be >= 0, followup_drafts > 0")

    @property
    def used_edges(self) -> tuple[int, ...]:
        return tuple(e for e in self.edges if e <= self.max_batch)


@dataclass(frozen=True)
class Figures:
    """What one window showed: acceptance per position (unconditional), batch-size time shares."""

    per_position: tuple[float, ...]
    batch_weights: Mapping[int, float]
    drafts: float
    load: float = 0.0  # 0..1: how full the engine ran (KV usage or batch over the maximum)
    # Drafts that proposed each position (see :func:`position_reach`); empty: not known, and
    # every position counts as measured.
    position_drafts: tuple[float, ...] = ()


@dataclass(frozen=True)
class RangeChoice:
    label: str
    current_k: int
    best_k: int
    chosen_k: int
    gain: float  # chosen over current, for this range


@dataclass(frozen=True)
class Decision:
    action: str  # "change", "keep" or "wait"
    reason: str
    current: Schedule
    proposed: Schedule
    predicted_gain: float
    ranges: tuple[RangeChoice, ...]
    required_gain: float = 0.0
    provisional: bool = False  # a change on thin evidence: a follow-up will be allowed
    followup: bool = False  # this was the follow-up evaluation of a provisional change

    def as_log(self) -> dict[str, object]:
        return {"action": self.action, "reason": self.reason,
                "predicted_gain": round(self.predicted_gain, 4),
                "required_gain": round(self.required_gain, 4),
                "provisional": self.provisional, "followup": self.followup,
                "ranges": [c.__dict__ for c in self.ranges]}


@dataclass(frozen=True)
class PolicyState:
    last_change_at: float = -math.inf
    streak: int = 0
    last_proposal: Schedule = ()
    # A shift found stands in for the confirmations until a change is made or the new regime
    # says keep: a change held for the pool's lease must not start counting them again.
    confirmed: bool = False
    followup: bool = False  # the last change was provisional and not yet re-evaluated


def extend_positions(per_position: tuple[float, ...], max_k: int) -> tuple[float, ...]:
    """Measured positions, then the last conditional rate repeated up to ``max_k``."""
    rates = [min(1.0, max(0.0, p)) for p in per_position[:max_k]]
    for i in range(1, len(rates)):
        rates[i] = min(rates[i], rates[i - 1])
    if not rates:
        return ()
    prev = rates[-2] if len(rates) >= 2 else 1.0
    conditional = min(1.0, rates[-1] / prev) if prev > 0 else 0.0
    while len(rates) < max_k:
        rates.append(rates[-1] * conditional)
    return tuple(rates)


def position_reach(drafts: float, batch_weights: Mapping[int, float], current: Schedule,
                   max_k: int) -> tuple[float, ...]:
    """How many of a window's ``drafts`` proposed each position ``0..max_k-1``: a draft proposes
    position ``i`` only in steps whose K exceeds ``i`` (inferred from the batch sizes seen)."""
    if drafts <= 0:
        return ()
    share = {b: w * b for b, w in batch_weights.items()
             if b > 0 and k_for_batch(current, b, max_k) > 0}
    drafted = sum(share.values())
    if drafted <= 0:
        return (drafts,) * max_k
    return tuple(drafts * sum(w for b, w in share.items() if k_for_batch(current, b, max_k) > i)
                 / drafted for i in range(max_k))


def estimate_positions(accepted_per_pos: tuple[float, ...], drafts: float,
                       batch_weights: Mapping[int, float], current: Schedule,
                       max_k: int) -> tuple[float, ...]:
    """Unconditional acceptance per position from a window's counter deltas (see module rules)."""
    reach = position_reach(drafts, batch_weights, current, max(max_k, len(accepted_per_pos)))
    rates: list[float] = []
    for accepted, proposed in zip(accepted_per_pos, reach, strict=False):
        if proposed <= 0:
            break
        rates.append(min(1.0, accepted / proposed))
    return extend_positions(tuple(rates), max_k)


def drafted_k(schedule: Schedule, weights: Mapping[int, float], max_k: int) -> int:
    """The longest draft ``schedule`` runs at the batch sizes seen."""
    return max((k_for_batch(schedule, b, max_k) for b, w in weights.items() if b > 0 and w > 0),
               default=0)


def measured(figures: Figures, k: int, drafts: float) -> bool:
    """Whether positions ``0..k-1`` were each proposed by at least ``drafts`` drafts."""
    reach = figures.position_drafts
    if not reach:
        return True
    return all(i < len(reach) and reach[i] >= drafts for i in range(k))


def _rate(cost: StepCost, p: tuple[float, ...], b: int, k: int) -> float:
    tokens = tokens_per_step(p, k)
    return b * tokens / cost.step_time(b, k, tokens)


def _range_value(cost: StepCost, p: tuple[float, ...], r: Range, weights: Mapping[int, float],
                 k: int) -> float:
    seen = {b: w for b, w in weights.items() if r.start <= b <= r.end and w > 0}
    if not seen:
        seen = {max(r.start, round(math.sqrt(r.start * r.end))): 1.0}
    return sum(w * _rate(cost, p, b, k) for b, w in seen.items()) / sum(seen.values())


def _choose(settings: PolicySettings, cost: StepCost, p: tuple[float, ...], r: Range, *,
            weights: Mapping[int, float], current_k: int, lowest: bool) -> RangeChoice:
    values = [_range_value(cost, p, r, weights, k) for k in range(settings.max_k + 1)]
    top = max(values)
    best = next(k for k, v in enumerate(values) if v >= top * (1 - settings.tie))
    chosen = best
    if lowest:
        chosen = max(chosen, settings.probe_k)
    gain = values[chosen] / values[current_k] - 1 if values[current_k] > 0 else 0.0
    return RangeChoice(r.label, current_k, best, chosen, gain)


def throughput(cost: StepCost, p: tuple[float, ...], schedule: Schedule,
               weights: Mapping[int, float], max_k: int) -> float:
    """Tokens per second the engine would make at the batch sizes seen (time-weighted)."""
    total = sum(w for b, w in weights.items() if b > 0)
    if total <= 0:
        return 0.0
    return sum(w * _rate(cost, p, b, k_for_batch(schedule, b, max_k))
               for b, w in weights.items() if b > 0) / total


def propose(settings: PolicySettings, cost: StepCost, figures: Figures,
            current: Schedule) -> tuple[Schedule, tuple[RangeChoice, ...], float]:
    p = extend_positions(figures.per_position, settings.max_k)
    edges = settings.used_edges
    template = from_edges(edges, [0] * len(edges), settings.max_batch)
    choices = tuple(
        _choose(settings, cost, p, r, weights=figures.batch_weights,
                current_k=k_for_batch(current, r.start, settings.max_k), lowest=i == 0)
        for i, r in enumerate(template))
    proposed = from_edges(edges, [c.chosen_k for c in choices], settings.max_batch)
    before = throughput(cost, p, current, figures.batch_weights, settings.max_k)
    after = throughput(cost, p, proposed, figures.batch_weights, settings.max_k)
    gain = after / before - 1 if before > 0 else 0.0
    return proposed, choices, gain


def _same_ks(a: Schedule, b: Schedule, max_k: int, max_batch: int) -> bool:
    return all(k_for_batch(a, n, max_k) == k_for_batch(b, n, max_k)
               for n in range(1, max_batch + 1))


def required_gain(settings: PolicySettings, load: float, out_s: float | None, *,
                  margin: float | None = None) -> float:
    """The least predicted gain that pays for a restart at ``load``: the margin (``margin``, or
    the settings'), plus the share of the engine's output the pool cannot absorb while it is out,
    spread over the horizon."""
    spill = min(1.0, max(0.0, (load - settings.spare_load) / (1.0 - settings.spare_load)))
    out = settings.restart_cost_s if out_s is None else out_s
    return (settings.margin if margin is None else margin) + spill * out / settings.horizon_s


def _is_followup(settings: PolicySettings, state: PolicyState, figures: Figures,
                 current: Schedule) -> bool:
    """A provisional change is re-evaluated once its schedule's positions are measured."""
    k = drafted_k(current, figures.batch_weights, settings.max_k)
    return state.followup and measured(figures, k, settings.followup_drafts)


def decide(settings: PolicySettings, state: PolicyState, cost: StepCost, figures: Figures, *,
           current: Schedule, now: float, out_s: float | None = None,
           shifted: bool = False) -> tuple[Decision, PolicyState]:
    """One evaluation: the decision and the policy's next state. ``out_s``: how long the last
    restart kept the engine out (None: not measured yet); ``shifted``: the shift test fired."""
    if not any(w > 0 for b, w in figures.batch_weights.items() if b > 0):
        return _hold("wait", "no load observed", current, state), replace(state, streak=0)
    if not figures.per_position or figures.drafts < settings.min_drafts:
        reason = f"acceptance not measured yet ({figures.drafts:.0f} drafts in the window)"
        return _hold("wait", reason, current, state), replace(state, streak=0)
    followup = _is_followup(settings, state, figures, current)
    margin = min(settings.followup_margin, settings.margin) if followup else settings.margin
    proposed, choices, gain = propose(settings, cost, figures, current)
    need = required_gain(settings, figures.load, out_s, margin=margin)
    if _same_ks(proposed, current, settings.max_k, settings.max_batch) or gain <= margin:
        decision = Decision("keep", f"predicted gain {gain:+.1%} within margin", current,
                            proposed, gain, choices, need, followup=followup)
        return decision, replace(state, streak=0, last_proposal=(), confirmed=False,
                                 followup=state.followup and not followup)
    same = bool(state.last_proposal) and _same_ks(proposed, state.last_proposal,
                                                  settings.max_k, settings.max_batch)
    confirmed = shifted or state.confirmed
    streak = settings.confirmations if confirmed or followup else \
        state.streak + 1 if same else 1
    state = replace(state, streak=streak, last_proposal=proposed, confirmed=confirmed)
    provisional = not followup and not measured(
        figures, drafted_k(proposed, figures.batch_weights, settings.max_k),
        settings.followup_drafts)

    def out(action: str, why: str) -> tuple[Decision, PolicyState]:
        return Decision(action, why, current, proposed, gain, choices, need,
                        provisional=provisional, followup=followup), state

    if streak < settings.confirmations:
        return out("wait", f"gain {gain:+.1%}: confirmation {streak}/{settings.confirmations}")
    if gain <= need:
        return out("wait", f"gain {gain:+.1%}: not worth a restart at load "
                           f"{figures.load:.0%} (needs {need:+.1%})")
    if now - state.last_change_at < settings.min_interval_s and not followup:
        left = settings.min_interval_s - (now - state.last_change_at)
        return out("wait", f"gain {gain:+.1%}: last change too recent ({left:.0f} s to go)")
    return out("change", f"predicted gain {gain:+.1%}" + (" (follow-up)" if followup else ""))


def committed(state: PolicyState, now: float, decision: Decision | None = None) -> PolicyState:
    """The state after ``decision`` was rolled out at ``now``: a provisional change leaves one
    follow-up evaluation pending."""
    return PolicyState(last_change_at=now,
                       followup=decision is not None and decision.provisional)


def _hold(action: str, reason: str, current: Schedule, state: PolicyState) -> Decision:
    return Decision(action, reason, current, current, 0.0, ())
