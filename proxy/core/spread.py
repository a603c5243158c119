"""Spreading the picks of proxy processes that rank engines on the same shared view. Pure: no
I/O, no clock; the random draw is passed in.

Why: replicas that share their routing state (``proxy.core.sharing``) rank a pool's engines on
nearly the same view. Requests that reach different replicas within one sharing round (a burst,
balanced round-robin over the replicas) are each ranked without the others' dispatches, and a
deterministic ranking sends all of them to the same engine: herding on old information
(Mitzenmacher, "How useful is old information?", 2000). Randomised choice among the places that
the unseen requests could take is what stays robust.

Rules:
- ``unseen``: how many requests the other processes are expected to have sent to the pool that
  this process has not merged yet. ``Blindness`` estimates it from this process's own arrivals:
  a balancer spreads requests evenly over the processes, so in the window where a peer's
  dispatch is still unseen (since this process's last merge plus one publication interval) each
  live peer sent about as many as this process did, this request included. That follows a burst
  as it happens, which a mean rate would not.
- ``spread_pick``: the cost model's pick is the first of ``1 + unseen`` places; the others go
  greedily, one by one, to the engine whose cost with the places it already has is lowest, each
  place adding ``step_s[engine]`` (a request of the pool's mean prompt, nothing cached). The
  request takes one place uniformly at random (``draw`` in [0, 1); a fractional last place
  weighs its fraction), so simultaneous requests at different replicas land as one router would
  have placed them one after the other.
- Only engines that hold as much of the prompt as the pick (within ``held_slack`` tokens) take
  places: spreading never trades a cache hit for balance.
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
    """This process's own recent arrivals, to estimate how many of its peers' decisions are
    concurrent with one of its own (module rules). Times are the caller's clock, in seconds."""

    def __init__(self, interval_s: float, max_kept: int = 4096) -> None:
        self.interval_s = interval_s
        self._sent: deque[float] = deque(maxlen=max_kept)
        self._merged_at = -math.inf
        self._peers = 0
        self._ahead = 0.0  # moving average of the past part: the expected future part

    def merged(self, now: float, peers: int) -> None:
        """A sharing round merged what ``peers`` live processes published."""
        self._merged_at = now
        self._peers = max(0, peers)

    def unseen(self, now: float) -> float:
        """Peer decisions expected to be concurrent with one taken at ``now``: those made since
        the last merge plus one publication interval (each of this process's arrival gaps in that
        window held ``peers`` peer arrivals, a gap cut by the window's start its share), plus as
        many expected in the next such window (a moving average of the past part: a burst shows
        in it). Records ``now`` as an arrival: call it once per decision."""
        if self._peers == 0:
            self._sent.append(now)
            return 0.0
        start = min(now, self._merged_at - self.interval_s)
        sent = self._sent
        while len(sent) > 1 and sent[1] < start:
            sent.popleft()
        past, before = 0.0, None
        for at in (*sent, now):
            if before is not None:
                gap = at - before
                past += 1.0 if before >= start else (at - start) / gap if at > start else 0.0
            before = at
        past *= self._peers
        sent.append(now)
        ahead = self._ahead
        self._ahead += _AHEAD_WEIGHT * (past - ahead)
        return past + ahead


# Weight of one decision in the moving average of the concurrent peer decisions.
_AHEAD_WEIGHT = 1.0 / 16
