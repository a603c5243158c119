"""Routing decisions that see each other: the pure part of decisions serialised between proxy
processes through a shared store (Redis; the script and the shell are
``proxy.tenancy.shared_decision``). Pure: no I/O, no clock.

Why: replicas that share their routing state asynchronously (``proxy.core.sharing``, a round
every ``sharing.interval_s``) cannot see what the others decide within one round, and requests
that reach several replicas at one instant (a burst balanced over them) cannot see each other
through any asynchronous transport: each ranks on the same view and they herd onto one engine.
``proxy.core.spread`` randomises to narrow that; it cannot close it. What closes it is making
the part of the decision that depends on the others' work in flight in one place, one decision
after the other: the store. Only that part goes there, so a decision costs one round trip and
the store needs no model of engines.

Rules:
- The split. Everything this process knows by itself stays the local cost model's
  (``proxy.core.costmodel``): prefix hit, pressure, health, eligibility, the snapshot, this
  process's own requests. What goes to the store, per candidate engine, is the local cost with
  the other processes' pending prompt tokens left out (``cost_s``) and the seconds one such token
  adds (``slope_s``: the cost is linear in the prompt tokens queued ahead, see
  ``costmodel.queue_step``). The store adds ``slope_s`` times the tokens every other live process
  has claimed there, picks as ``choose_claimed`` does, and adds this request's uncached tokens to
  this process's own claim at the pick, atomically.
- This process's own claims that the store holds but its ledger does not know yet (decisions
  whose answer is still on the way: two requests of one burst at one replica) count too: the
  store's own field less ``claimed`` (the ledger's figure, sent with the candidate).
- Candidates: the local ranking's pick and every engine holding as much of the prompt within
  ``held_slack`` tokens (the spread's rule: sharing never trades a cache hit for balance), in the
  local ranking's order, at most ``MAX_CANDIDATES``.
- ``choose_claimed`` is ``costmodel.choose`` on the totals: the lowest, and among the totals
  within ``tolerance`` of it the engine holding the most, then the lowest total, then the
  candidates' order. The store's script does the same; a test on a real Redis checks they agree.
- Figures read from the store are hostile (``amount``): not a number, negative, above
  ``MAX_TOKENS``, infinite, NaN or longer than ``MAX_TEXT`` characters is ignored (counts 0).
- The ledger (``ClaimLedger``): a process's claim at an engine is what it believes its prompt
  tokens without a first byte there are. Claims are added by decisions; each sharing round
  moves the claims towards the engines' local backlogs by deltas (first bytes, ends, failures,
  requests sent without a decision), which commute with decisions in flight. An answer lost to a
  timeout leaves the store unsure: the ledger is then ``dirty`` and the next round with no
  decision in flight (or the ``FORCE_ROUNDS``-th) writes absolute figures instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from proxy.core.spread import Costed

MAX_CANDIDATES = 32
MAX_TOKENS = 1e12
MAX_TEXT = 32
# Deltas under this many tokens are not worth a write.
_EPSILON = 0.5
# Rounds a dirty ledger waits for a moment with no decision in flight before writing anyway.
FORCE_ROUNDS = 8


class Claimable(NamedTuple):
    """One candidate engine of one decision, as the store's script receives it."""

    name: str
    cost_s: float  # the local cost, the other processes' pending prompt tokens left out
    slope_s: float  # seconds of cost per pending prompt token queued at the engine
    held: float  # prompt tokens the engine holds
    tokens: float  # prompt tokens this request adds there (uncached)


def claimables(estimates: Sequence[Costed], ranked: Sequence[str], *, slopes: Mapping[str, float],
               remote: Mapping[str, float], prompt_tokens: float,
               held_slack: float) -> tuple[Claimable, ...]:
    """The candidates of a decision (module rules), ``ranked``'s first one first."""
    if not ranked:
        return ()
    by_name = {e.name: e for e in estimates}
    floor = by_name[ranked[0]].held - held_slack
    out: list[Claimable] = []
    for name in ranked:
        e = by_name.get(name)
        if e is None or e.held < floor or name not in slopes:
            continue
        slope = slopes[name]
        out.append(Claimable(name, e.cost_s - slope * remote.get(name, 0.0), slope, e.held,
                             max(0.0, prompt_tokens - e.held)))
        if len(out) == MAX_CANDIDATES:
            break
    return tuple(out)


def choose_claimed(cands: Sequence[Claimable], others: Sequence[float], tolerance: float) -> int:
    """Index of the pick among ``cands`` with ``others[i]`` pending tokens of the other processes
    at each (module rules; the reference of the store's script)."""
    totals = [c.cost_s + c.slope_s * max(0.0, o) for c, o in zip(cands, others, strict=True)]
    best = min(totals)
    near = [i for i, t in enumerate(totals) if t <= best + abs(best) * tolerance]
    return min(near, key=lambda i: (-cands[i].held, totals[i], i))


def amount(raw: object) -> float | None:
    """A figure read from the store, or None when it is hostile (module rules)."""
    if isinstance(raw, bytes):
        raw = raw.decode("latin-1")
    if not isinstance(raw, str) or len(raw) > MAX_TEXT:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0.0 <= value <= MAX_TOKENS else None


def reorder(ranked: Sequence[str], pick: str) -> tuple[str, ...]:
    """``ranked`` with ``pick`` first; the others keep their order (retry targets)."""
    return (pick, *(n for n in ranked if n != pick))


def parse_reply(raw: object, candidates: int) -> int | None:
    """The pick's index from the script's reply ``[1, index, ...]``; None for anything else
    (``[0]``: the store's state was out of bounds)."""
    if not isinstance(raw, list) or len(raw) < 2 or raw[0] != 1:
        return None
    index = raw[1]
    if type(index) is not int or not 0 <= index < candidates:
        return None
    return index


@dataclass(frozen=True)
class Writes:
    """One round's writes of a process's claims: deltas to add, or absolute figures to set."""

    absolute: bool
    values: Mapping[str, float]


@dataclass
class ClaimLedger:
    """What this process believes its claim fields in the store hold, per engine."""

    claimed: dict[str, float] = field(default_factory=dict)
    outstanding: int = 0  # decisions sent and not answered
    dirty: bool = False  # the store may differ from ``claimed`` (an answer was lost)
    _dirty_rounds: int = 0

    def at(self, engine: str) -> float:
        return self.claimed.get(engine, 0.0)

    def granted(self, engine: str, tokens: float) -> None:
        """A decision's answer: the store added ``tokens`` to this process's claim there."""
        self.claimed[engine] = self.at(engine) + tokens

    def lost(self) -> None:
        """A write whose outcome is unknown (a timeout, a broken connection)."""
        self.dirty = True

    def plan(self, backlog: Mapping[str, float]) -> Writes:
        """This round's writes towards ``backlog`` (per engine: prompt tokens without a first
        byte, as this process counts them; engines left out count 0)."""
        names = set(backlog) | set(self.claimed)
        if self.dirty:
            self._dirty_rounds += 1
            if self.outstanding == 0 or self._dirty_rounds >= FORCE_ROUNDS:
                return Writes(True, {n: max(0.0, backlog.get(n, 0.0)) for n in names})
        deltas = {n: backlog.get(n, 0.0) - self.at(n) for n in names}
        return Writes(False, {n: d for n, d in deltas.items() if abs(d) >= _EPSILON})

    def applied(self, writes: Writes) -> None:
        """``writes`` reached the store."""
        if writes.absolute:
            self.claimed = {n: v for n, v in writes.values.items() if v > 0.0}
            self.dirty, self._dirty_rounds = False, 0
            return
        for name, delta in writes.values.items():
            value = max(0.0, self.at(name) + delta)
            if value > 0.0:
                self.claimed[name] = value
            else:
                self.claimed.pop(name, None)
