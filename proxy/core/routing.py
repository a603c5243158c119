"""Routing policies: which engine of a pool serves a request. Pure: no I/O, no clock, no randomness.

Rules:
- A policy ranks the routable engines of one pool, best first: ``rank()[0]`` is the pick and
  ``rank()[1]`` the retry target. Unroutable engines never appear. Fresh engines come before stale
  ones; stale engines are ranked only when no engine is fresh, and then least-loaded first (fail
  open: their figures are old, only the proxy's own in-flight counts are current).
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
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from hashlib import blake2b
from typing import Protocol

from proxy.core.config import RoutingConfig
from proxy.core.pressure import NO_PRESSURE, Pressure

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class EngineView:
    """One engine as routing and admission see it at one instant."""

    name: str
    routable: bool  # healthy or stale, breaker allows, not draining
    fresh: bool  # its snapshot is recent
    load: float  # running + waiting + dispatched since the snapshot
    kv_usage: float  # 0..1
    block_size: int | None = None
    # Prompt blocks this proxy sent the engine that it has not answered yet (its prefill backlog).
    prefill: float = 0.0
    # KV overcommit guard: the classes this engine is closed to, and why (``proxy.core.pressure``).
    pressure: Pressure = NO_PRESSURE


@dataclass(frozen=True)
class RouteKey:
    """What routing knows of a request: its prefix chain, tenant and model."""

    chain: tuple[int, ...]
    tenant: str = "default"
    model: str = ""
    # Precise holdings (``proxy.core.holdings``), in chain blocks, of the engines whose KV events
    # are in sync: for those engines they replace the approximate index's guess.
    held: Mapping[str, int] | None = field(default=None, compare=False)


def _depths(index: BlockIndex, key: RouteKey, engines: Sequence[str]) -> dict[str, int]:
    depths = index.match_depths(key.chain, engines)
    if key.held:
        depths = {e: d for e, d in depths.items() if e not in key.held}
        depths.update((e, d) for e, d in key.held.items() if d > 0 and e in engines)
    return depths


class Policy(Protocol):
    name: str

    def rank(self, key: RouteKey, engines: Sequence[EngineView]) -> tuple[str, ...]:
        """Routable engine names, best first."""
        ...

    def observe(self, key: RouteKey, engine: str) -> None:
        """The request with ``key`` was sent to ``engine`` (lets a policy learn; may do nothing)."""
        ...

    def uncached(self, key: RouteKey, engine: str) -> int:
        """Blocks of ``key``'s chain that ``engine`` is expected to compute (not hold cached)."""
        ...

    def forget(self, engine: str) -> None:
        """``engine`` left the pool: drop what the policy keeps about it."""
        ...


def candidates(engines: Sequence[EngineView]) -> tuple[list[EngineView], bool]:
    """The engines a request may go to and whether they are all stale (fail-open)."""
    fresh = [e for e in engines if e.routable and e.fresh]
    if fresh:
        return fresh, False
    return [e for e in engines if e.routable], True


def least_loaded(engines: Sequence[EngineView]) -> list[EngineView]:
    """Least load first; KV usage breaks ties, then the name (for determinism)."""
    return sorted(engines, key=lambda e: (e.load, e.kv_usage, e.name))


def load_bound(engines: Sequence[EngineView], load_factor: float, floor: int = 1) -> float:
    """Most load one engine may carry after taking one more request.

    ``floor`` keeps a nearly idle pool from spilling: with one request in flight over three
    engines the mean bound is 1, which would move a conversation's second turn off its home
    engine although no engine is anywhere near busy.
    """
    total = sum(max(0.0, e.load) for e in engines)
    return max(floor, math.ceil(load_factor * (total + 1) / max(1, len(engines))))


def mix64(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit permutation."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


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

    def uncached(self, key: RouteKey, engine: str) -> int:
        return len(key.chain)

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


class BlockIndex:
    """Per engine, the most recently routed block hashes (LRU, at most ``capacity`` each)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # First key: the least recently routed. OrderedDict pops its head in O(1); a plain dict
        # would rescan the holes its deletions leave at the front.
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def add(self, engine: str, chain: Sequence[int]) -> None:
        if self.capacity <= 0:
            return
        blocks = self._blocks.setdefault(engine, OrderedDict())
        # Deepest first, so a prefix's first blocks are the most recent and are evicted last,
        # as an engine's own LRU keeps a shared prefix longer than one request's tail.
        for h in reversed(chain):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def match_depths(self, chain: Sequence[int], engines: Sequence[str]) -> dict[str, int]:
        """For each of ``engines`` with a match, the deepest depth of ``chain`` routed to it."""
        depths: dict[str, int] = {}
        for engine in engines:
            blocks = self._blocks.get(engine)
            if not blocks:
                continue
            for depth in range(len(chain), 0, -1):
                if chain[depth - 1] in blocks:
                    depths[engine] = depth
                    break
        return depths

    def size(self, engine: str) -> int:
        return len(self._blocks.get(engine, ()))

    def forget(self, engine: str) -> None:
        self._blocks.pop(engine, None)


class PrefixAffinity:
    """Rendezvous order on the prefix key, longest routed prefix first, bounded by load."""

    name = "prefix_affinity"

    def __init__(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        self.index = BlockIndex(cfg.index_blocks)
        self._seed = cfg.seed.to_bytes(8, "big")
        self._salts: dict[str, int] = {}

    def _salt(self, engine: str) -> int:
        salt = self._salts.get(engine)
        if salt is None:
            digest = blake2b(engine.encode(), digest_size=8, key=self._seed).digest()
            salt = self._salts[engine] = int.from_bytes(digest, "big")
        return salt

    def preference(self, key: RouteKey, engines: Sequence[EngineView]) -> list[EngineView]:
        """Engines in preference order for ``key``, before the load bound is applied."""
        chain = key.chain or (0,)
        depths = _depths(self.index, replace(key, chain=chain), [e.name for e in engines])
        common = common_depth(depths, len(engines))
        # Key one block past the prefix most engines hold: a shared system prompt then spreads
        # its conversations by what follows it instead of piling them onto one home.
        k = chain[min(len(chain), max(self.cfg.affinity_blocks, common + 1)) - 1]
        order = sorted(engines, key=lambda e: (-mix64(k ^ self._salt(e.name)), e.name))
        deepest = max(depths.values(), default=0)
        if deepest <= common or deepest < self.cfg.min_match_blocks:
            if self.cfg.place_new == "rendezvous":
                return order
            if self.cfg.place_new == "prefill":
                return _by_prefill(order, len(chain), depths)
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

    def uncached(self, key: RouteKey, engine: str) -> int:
        depth = _depths(self.index, key, [engine]).get(engine, 0)
        return len(key.chain) - depth

    def forget(self, engine: str) -> None:
        self.index.forget(engine)
        self._salts.pop(engine, None)


def _by_prefill(order: Sequence[EngineView], blocks: int,
                depths: Mapping[str, int]) -> list[EngineView]:
    """Least prompt work to wait for and to do first: the engine's prefill backlog plus the blocks
    of this prompt it does not hold; then the least loaded; ``order`` breaks the remaining ties."""
    rank = {e.name: i for i, e in enumerate(order)}
    return sorted(order, key=lambda e: (e.prefill + blocks - depths.get(e.name, 0), e.load,
                                        rank[e.name]))


def make_policy(cfg: RoutingConfig) -> Policy:
    """A fresh policy object for ``cfg.policy`` (one per pool: policies keep per-pool state)."""
    if cfg.policy == "round_robin":
        return RoundRobin()
    if cfg.policy == "least_load":
        return LeastLoad()
    if cfg.policy == "prefix_affinity":
        return PrefixAffinity(cfg)
    raise ValueError(f"unknown routing policy {cfg.policy!r}")
