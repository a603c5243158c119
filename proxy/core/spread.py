"""Spreading the picks of proxy processes that rank engines on the same shared view. Pure: no
I/O, no clock; the random draw is passed in.

Why: replicas that share their routing state (``proxy.core.sharing``) rank a pool's engines on
nearly the same view. Requests that reach different replicas within one sharing round (a burst,
balanced round-robin over the replicas) are each ranked without the others' dispatches, and a
deterministic ranking sends all of them to the same engine: herding on old information
(Mitzenmacher, "How useful is old information?", 2000). Randomised choice among the places that
the unseen requests could take is what stays robust.

Rules:
- ``unseen``: how many requests the other processes are expected to send to the pool
  concurrently with this decision, unseen by it or not seeing it: those made since this
  process's last merge (less one publication interval) or before its dispatch reaches them.
  ``Blindness`` learns it from the merges themselves: the peer dispatches the two merges after
  each decision held, averaged over decisions. Averaged over decisions, not over time, a burst
  weighs as much as the decisions it brings: where requests come in bursts that the balancer
  spreads over the replicas, the first request of a burst at each replica expects the others.
- ``spread_pick``: the cost model's pick is the first of ``1 + unseen`` places; the others go
  greedily, one by one, to the engine whose cost with the places it already has is lowest, each
  place adding ``step_s[engine]`` (a request of the pool's mean prompt, nothing cached). The
  request takes one place uniformly at random (``draw`` in [0, 1); a fractional last place
  weighs its fraction), so simultaneous requests at different replicas land as one router would
  have placed them one after the other.
- Only engines that hold as much of the prompt as the pick (within ``held_slack`` tokens: the
  cost model allows its tolerance's share of the prompt) take places: spreading never trades a
  cache hit for balance.
- With ``unseen`` 0 (one process, sharing off, no live peer) the ranking is returned unchanged.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["Blindness", "Costed", "places", "spread_pick"]


class Costed(Protocol):
    """One engine's figures for one request (``proxy.core.costmodel.Estimate``)."""

    @property
    def name(self) -> str: ...

    @property
    def cost_s(self) -> float: ...

    @property
    def held(self) -> float: ...


def places(estimates: Sequence[Costed], first: str, step_s: Mapping[str, float],
           count: int, held_slack: float) -> list[str]:
    """``count`` places after ``first`` (see the module rules), ``first`` included: the engine
    names in placing order, one per place (an engine may take several)."""
    pick = next(e for e in estimates if e.name == first)
    eligible = {e.name: e.cost_s for e in estimates
                if e.held >= pick.held - held_slack and e.name in step_s}
    eligible[first] = eligible.get(first, pick.cost_s) + step_s.get(first, 0.0)
    out = [first]
    for _ in range(count):
        name = min(eligible, key=lambda n: (eligible[n], n))
        out.append(name)
        eligible[name] += step_s[name]
    return out


def spread_pick(ranked: Sequence[str], estimates: Sequence[Costed], step_s: Mapping[str, float],
                *, unseen: float, draw: float, held_slack: float) -> tuple[str, ...]:
    """``ranked`` (best first) with its first engine replaced by the place ``draw`` falls on
    (module rules); the rest keep their order."""
    if unseen <= 0.0 or not ranked or not math.isfinite(unseen):
        return tuple(ranked)
    extra = math.ceil(unseen)
    spots = places(estimates, ranked[0], step_s, extra, held_slack)
    index = min(int(min(max(draw, 0.0), 1.0 - 1e-12) * (1.0 + unseen)), extra)
    pick = spots[index]
    if pick == ranked[0]:
        return tuple(ranked)
    return (pick, *(n for n in ranked if n != pick))


class Blindness:
    """What the merges reveal after this process's decisions: how many peer dispatches each
    turned out to be concurrent with (module rules). Times are the caller's clock, in seconds."""

    def __init__(self, max_open: int = 4096) -> None:
        self.expected = 0.0  # peer dispatches concurrent with one decision, moving average
        self._peers = 0
        # Per decision not yet judged: merges seen since it (0 or 1) and dispatches they held.
        self._open: deque[list[int]] = deque(maxlen=max_open)

    def merged(self, peers: int, dispatches: int) -> None:
        """A sharing round merged ``dispatches`` peer dispatches to the pool from ``peers`` live
        processes (0 peers: routing alone, nothing is expected)."""
        self._peers = max(0, peers)
        for entry in self._open:
            entry[0] += 1
            entry[1] += dispatches
        while self._open and self._open[0][0] >= _MERGES:
            self.expected += _WEIGHT * (self._open.popleft()[1] - self.expected)

    def unseen(self) -> float:
        """Peer dispatches expected to be concurrent with a decision taken now; records the
        decision, so call it once per decision."""
        if self._peers == 0:
            return 0.0
        self._open.append([0, 0])
        return self.expected


# A peer's dispatch made shortly before a decision shows in the first merge after it, one made
# shortly after in the first or second (the peer publishes, then this process merges, each once
# per interval): the two merges after a decision hold the dispatches concurrent with it.
_MERGES = 2
# Weight of one decision in the moving average.
_WEIGHT = 1.0 / 16
