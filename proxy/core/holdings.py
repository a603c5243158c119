"""Prefix holdings: how many of a request's prompt tokens each engine is believed to hold cached.

Rules:
- ``PrefixHoldings`` is the one question the cost model asks about engines' caches. Any source of
  that knowledge implements it: the approximate index here (what this proxy routed where), or an
  exact index fed by the engines' own KV-cache events.
- ``record`` is called at dispatch, before the engine has computed anything: the entry is
  provisional (the engine will hold the prompt once it has prefilled it), so that a burst of
  requests sharing a new prefix can follow the first one before any engine reports it. An exact
  index keeps such entries on the side for a few seconds and lets the engine's events confirm or
  drop them; the approximate index has nothing else and keeps them until evicted.
- ``settled_tokens`` asks only what an engine is known to have computed: in the approximate
  index a chain is settled once ``confirm`` reports that the request that recorded it had its
  first byte there (the engine has prefilled the prompt); an exact index settles blocks when the
  engine's events report them (``confirm`` has nothing to do). Settled never exceeds held: the
  settled blocks are a second bounded ``BlockIndex``, and an engine's settled depth is capped
  at its held depth (the held index may have evicted a chain the settled one still keeps).
  Confirming a chain never recorded there is harmless: it cannot raise settled above held.
- Other proxy processes' dispatches (``proxy.tenancy.shared_routing``) are recorded like this
  process's own, and confirmed when the sender shares their first bytes (``proxy.core.sharing``):
  settled here as there. One whose confirmation never arrives (dropped, or sent by a process of
  an older version) stays provisional here.
- Pure: no I/O, no clock. Work per question is O(engines x chain length), never O(history);
  memory is bounded per engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Protocol

from proxy.core.routeview import RouteKey


class PrefixHoldings(Protocol):
    def held_tokens(self, key: RouteKey, engines: Sequence[str]) -> dict[str, float]:
        """Per engine of ``engines`` that holds some of ``key``'s prompt: the tokens it holds
        (a prefix of the prompt; absent engines hold nothing)."""
        ...

    def settled_tokens(self, key: RouteKey, engines: Sequence[str]) -> dict[str, float]:
        """Like ``held_tokens``, counting only what each engine is known to have computed
        (never more than ``held_tokens``)."""
        ...

    def record(self, key: RouteKey, engine: str) -> tuple[int, ...]:
        """``key``'s prompt was just sent to ``engine`` (provisional: computed soon); returns
        the blocks that were not recorded there before (for ``withdraw``)."""
        ...

    def withdraw(self, engine: str, blocks: Sequence[int]) -> None:
        """``engine`` refused the request whose ``record`` added ``blocks``: drop them."""
        ...

    def confirm(self, key: RouteKey, engine: str) -> None:
        """``engine`` has computed ``key``'s prompt (the request's first byte arrived)."""
        ...

    def forget(self, engine: str) -> None:
        """``engine`` left the pool: drop all that is kept about it."""
        ...


class BlockIndex:
    """Per engine, the most recently routed block hashes (LRU, at most ``capacity`` each)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # First key: the least recently routed. OrderedDict pops its head in O(1); a plain dict
        # would rescan the holes its deletions leave at the front.
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def add(self, engine: str, chain: Sequence[int]) -> tuple[int, ...]:
        """Record ``chain`` for ``engine``; returns the blocks that were not there before."""
        if self.capacity <= 0:
            return ()
        blocks = self._blocks.setdefault(engine, OrderedDict())
        # Only a chain's deepest blocks can be new: one held there means every shallower one
        # was recorded with it (module rules of ``match_depths``).
        held = held_depth(blocks, chain) if chain and chain[0] in blocks else 0
        # Deepest first, so a prefix's first blocks are the most recent and are evicted last,
        # as an engine's own LRU keeps a shared prefix longer than one request's tail.
        for h in reversed(chain):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        return tuple(chain[held:])

    def drop(self, engine: str, hashes: Sequence[int]) -> None:
        blocks = self._blocks.get(engine)
        if blocks:
            for h in hashes:
                blocks.pop(h, None)

    def match_depths(self, chain: Sequence[int], engines: Sequence[str]) -> dict[str, int]:
        """For each of ``engines`` with a match, the deepest depth of ``chain`` routed to it.

        Binary search: what an engine holds of one chain is always a prefix of it. A chain hash
        covers everything before it, so recording a block records all shallower ones of its
        chain as well, each more recently (deepest first), and LRU evicts the deeper first.
        """
        depths: dict[str, int] = {}
        for engine in engines:
            blocks = self._blocks.get(engine)
            if not blocks or chain[0] not in blocks:
                continue
            depths[engine] = held_depth(blocks, chain)
        return depths

    def size(self, engine: str) -> int:
        return len(self._blocks.get(engine, ()))

    def forget(self, engine: str) -> None:
        self._blocks.pop(engine, None)


class ApproxHoldings:
    """Holdings guessed from routing alone: an engine holds the longest prefix of a request's
    chain that was routed to it recently (``BlockIndex``), counted in tokens; of that, the
    chains confirmed computed there (a second ``BlockIndex``) are settled."""

    def __init__(self, capacity: int) -> None:
        self.index = BlockIndex(capacity)
        self.settled = BlockIndex(capacity)

    def held_tokens(self, key: RouteKey, engines: Sequence[str]) -> dict[str, float]:
        return _tokens(key, self.index.match_depths(key.chain, engines))

    def settled_tokens(self, key: RouteKey, engines: Sequence[str]) -> dict[str, float]:
        if not key.chain:
            return {}
        settled = self.settled.match_depths(key.chain, engines)
        if not settled:
            return {}
        held = self.index.match_depths(key.chain, list(settled))
        return _tokens(key, {e: min(d, held[e]) for e, d in settled.items() if e in held})

    def record(self, key: RouteKey, engine: str) -> tuple[int, ...]:
        return self.index.add(engine, key.chain)

    def withdraw(self, engine: str, blocks: Sequence[int]) -> None:
        self.index.drop(engine, blocks)
        self.settled.drop(engine, blocks)

    def confirm(self, key: RouteKey, engine: str) -> None:
        if key.chain:
            self.settled.add(engine, key.chain)

    def forget(self, engine: str) -> None:
        self.index.forget(engine)
        self.settled.forget(engine)


def _tokens(key: RouteKey, depths: dict[str, int]) -> dict[str, float]:
    tokens = key.tokens
    return {name: min(tokens, d * key.block_tokens) for name, d in depths.items()}


def held_depth(held: Container[int], chain: Sequence[int]) -> int:
    """How many leading blocks of ``chain`` are in ``held``, when what is held of a chain is
    always a prefix of it (a chain hash covers every block before it): a binary search."""
    lo, hi = 0, len(chain)  # chain[lo - 1] is held (or lo is 0); find the largest such lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chain[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo
