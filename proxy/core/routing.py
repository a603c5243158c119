"""Routing policies: which engine of a pool serves a request. Pure: no I/O, no clock, no randomness.

Rules:
- A policy ranks the routable engines of one pool, best first: ``rank()[0]`` is the pick and
  ``rank()[1]`` the retry target. Unroutable engines never appear. Fresh engines come before stale
  ones; stale engines are ranked only when no engine is fresh, and then least-loaded first (fail
  open: their figures are old, only the proxy's own in-flight counts are current).
- ``expected_ttft`` (the default, ``proxy.core.costmodel``) scores each engine by the seconds the
  request would wait there for its first token; the older policies stay selectable.
- ``prefix_affinity`` orders engines by rendezvous hashing of one hash of the request's prefix
  chain, seeded by ``routing.seed``, so every proxy replica computes the same order. A bounded
  index of recently routed block hashes per engine (longest-prefix match) refines it: engines that
  were routed a longer prefix of the request than most engines hold go to the front, and a prefix
  that most engines hold moves the rendezvous hash one block past it. The index only reorders.
- Bounded load (Mirrokni, Thorup, Zadimoghaddam 2018): an engine takes the request only if its load,
  the request included, stays within ``ceil(load_factor * (total_load + 1) / n)`` (never below
  ``min_load_bound``); otherwise the
  request spills to the next engine in the same order, which gives a prefix a stable second home.
- Everything is a deterministic function of the configuration and the sequence of ``rank`` and
  ``observe`` calls. Work per request is O(engines x chain length), never O(history).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.holdings import BlockIndex
from proxy.core.rendezvous import Rendezvous
from proxy.core.routeview import (
    EngineView,
    RouteKey,
    candidates,
    least_loaded,
    mix64,
    with_exact,
)

__all__ = [
    "BlockIndex", "EngineView", "LeastLoad", "Policy", "PrefixAffinity", "RoundRobin", "RouteKey",
    "candidates", "common_depth", "least_loaded", "load_bound", "make_policy", "mix64",
]


class Policy(Protocol):
    name: str

    def rank(self, key: RouteKey, engines: Sequence[EngineView]) -> tuple[str, ...]:
        """Routable engine names, best first."""
        ...

    def observe(self, key: RouteKey, engine: str) -> None:
        """The request with ``key`` was sent to ``engine`` (lets a policy learn; may do nothing)."""
        ...

    def confirm(self, key: RouteKey, engine: str) -> None:
        """Another process's request with ``key`` had its first byte from ``engine``: the engine
        has computed the prompt (``proxy.core.sharing``; may do nothing)."""
        ...

    def uncached_tokens(self, key: RouteKey, engine: str) -> float:
        """Prompt tokens of ``key`` that ``engine`` is expected to compute (not hold cached)."""
        ...

    def forget(self, engine: str) -> None:
        """``engine`` left the pool: drop what the policy keeps about it."""
        ...


def load_bound(engines: Sequence[EngineView], load_factor: float, floor: int = 1) -> float:
    """Most load one engine may carry after taking one more request.

    ``floor`` keeps a nearly idle pool from spilling: with one request in flight over three
    engines the mean bound is 1, which would move a conversation's second turn off its home
    engine although no engine is anywhere near busy.
    """
    total = sum(max(0.0, e.load) for e in engines)
    return max(floor, math.ceil(load_factor * (total + 1) / max(1, len(engines))))


def common_depth(depths: Mapping[str, int], n: int) -> int:
    """Deepest prefix depth that most engines hold (at least half of ``n``, and at least two)."""
    need = max(2, (n + 1) // 2)
    if len(depths) < need:
        return 0
    return sorted(depths.values(), reverse=True)[need - 1]


class _Unlearning:
    """The learning hooks of a policy that keeps no history: it assumes no engine holds a prompt."""

    def observe(self, key: RouteKey, engine: str) -> None:
        return None

    def confirm(self, key: RouteKey, engine: str) -> None:
        return None

    def uncached_tokens(self, key: RouteKey, engine: str) -> float:
        return key.tokens

    def forget(self, engine: str) -> None:
        return None


class RoundRobin(_Unlearning):
    """Each pick goes to the next engine in name order; a counter is the only state."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def rank(self, key: RouteKey, engines: Sequence[EngineView]) -> tuple[str, ...]:
        cands, stale_only = candidates(engines)
        if stale_only:
            return tuple(e.name for e in least_loaded(cands))
        names = sorted(e.name for e in cands)
        if not names:
            return ()
        start = self._counter % len(names)
        self._counter += 1
        return tuple(names[start:] + names[:start])


class LeastLoad(_Unlearning):
    """The engine with the least load (running + waiting + in flight) first."""

    name = "least_load"

    def rank(self, key: RouteKey, engines: Sequence[EngineView]) -> tuple[str, ...]:
        cands, _ = candidates(engines)
        return tuple(e.name for e in least_loaded(cands))


class PrefixAffinity:
    """Rendezvous order on the prefix key, longest routed prefix first, bounded by load."""

    name = "prefix_affinity"

    def __init__(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        self.index = BlockIndex(cfg.index_blocks)
        self._rendezvous = Rendezvous(cfg.seed)

    def preference(self, key: RouteKey, engines: Sequence[EngineView]) -> list[EngineView]:
        """Engines in preference order for ``key``, before the load bound is applied."""
        chain = key.chain or (0,)
        depths = self._depths(key, chain, [e.name for e in engines])
        common = common_depth(depths, len(engines))
        # Key one block past the prefix most engines hold: a shared system prompt then spreads
        # its conversations by what follows it instead of piling them onto one home.
        k = chain[min(len(chain), max(self.cfg.affinity_blocks, common + 1)) - 1]
        order = sorted(engines, key=lambda e: (-self._rendezvous.weight(k, e.name), e.name))
        deepest = max(depths.values(), default=0)
        if deepest <= common or deepest < self.cfg.min_match_blocks:
            if self.cfg.place_new == "rendezvous":
                return order
            if self.cfg.place_new == "prefill":
                return _by_prefill(order, key, depths)
            # Nothing of this request beyond the common prefix was routed anywhere: a new
            # conversation. Any engine serves it equally well from cache, so the least loaded
            # takes it (rendezvous order breaks ties, so an idle fleet still spreads by content);
            # its later turns then follow it through the index.
            rank = {e.name: i for i, e in enumerate(order)}
            return sorted(engines, key=lambda e: (e.load, rank[e.name]))
        # Some engines were routed a longer prefix than most hold (this conversation's earlier
        # turns, wherever they went): they go first, in rendezvous order among themselves.
        held = [e for e in order if depths.get(e.name, 0) == deepest]
        return held + [e for e in order if depths.get(e.name, 0) != deepest]

    def rank(self, key: RouteKey, engines: Sequence[EngineView]) -> tuple[str, ...]:
        cands, stale_only = candidates(engines)
        if stale_only:
            return tuple(e.name for e in least_loaded(cands))
        order = self.preference(key, cands)
        bound = load_bound(cands, self.cfg.load_factor, self.cfg.min_load_bound)
        within = [e.name for e in order if e.load + 1 <= bound]
        over = [e for e in order if e.load + 1 > bound]
        if not within:
            # Only fractional loads can leave no engine within the bound: then the least loaded.
            over = least_loaded(over)
        return tuple(within + [e.name for e in over])

    def observe(self, key: RouteKey, engine: str) -> None:
        self.index.add(engine, key.chain)

    def confirm(self, key: RouteKey, engine: str) -> None:
        return None  # the index keeps what was routed, computed or not

    def _depths(self, key: RouteKey, chain: Sequence[int], names: list[str]) -> dict[str, int]:
        """Chain blocks each engine holds: the index's guess, or the exact figure when known."""
        depths = self.index.match_depths(chain, names)
        if not key.held:
            return depths
        tokens = with_exact({e: d * key.block_tokens for e, d in depths.items()}, key, names)
        return {e: min(len(chain), int(t // key.block_tokens)) for e, t in tokens.items()}

    def uncached(self, key: RouteKey, engine: str) -> int:
        depth = self._depths(key, key.chain, [engine]).get(engine, 0)
        return len(key.chain) - depth

    def uncached_tokens(self, key: RouteKey, engine: str) -> float:
        held = (len(key.chain) - self.uncached(key, engine)) * key.block_tokens
        return max(0.0, key.tokens - held)

    def forget(self, engine: str) -> None:
        self.index.forget(engine)
        self._rendezvous.forget(engine)


def _by_prefill(order: Sequence[EngineView], key: RouteKey,
                depths: Mapping[str, int]) -> list[EngineView]:
    """Least prompt work to wait for and to do first: the engine's prefill backlog plus the tokens
    of this prompt it does not hold; then the least loaded; ``order`` breaks the remaining ties."""
    rank = {e.name: i for i, e in enumerate(order)}
    blocks, per_block = len(key.chain), key.block_tokens
    return sorted(order, key=lambda e: (
        e.prefill + (blocks - depths.get(e.name, 0)) * per_block, e.load, rank[e.name]))


def make_policy(cfg: RoutingConfig) -> Policy:
    """A fresh policy object for ``cfg.policy`` (one per pool: policies keep per-pool state)."""
    if cfg.policy == "round_robin":
        return RoundRobin()
    if cfg.policy == "least_load":
        return LeastLoad()
    if cfg.policy == "prefix_affinity":
        return PrefixAffinity(cfg)
    if cfg.policy == "expected_ttft":
        return ExpectedTTFT(cfg)
    raise ValueError(f"unknown routing policy {cfg.policy!r}")
