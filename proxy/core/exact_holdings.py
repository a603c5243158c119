"""How many of a request's prompt tokens each engine already holds in its KV cache.

Rules:
- ``Holdings`` is the question asked of an exact source: ``held_tokens(engine)`` is the number of
  the request's prompt tokens the engine holds as a cached prefix, or ``None`` when this source
  does not know the engine (routing then asks the approximate index).
- ``PreciseHoldings`` answers from the exact indexes (``kvindex``) of the engines whose KV events
  are in sync: the prompt's token ids are hashed as vLLM hashes them (``blockhash.chain_keys``,
  the request's ``cache_salt`` on the first block) in each engine's block size, and the longest
  prefix the engine holds counts ``blocks x block_size`` tokens. Engines out of sync are unknown.
- ``known`` gives the held tokens of the engines in sync; routing lays them over the approximate
  index's guess (``proxy.core.routeview.with_exact``). ``known_settled`` gives, of those, what
  the engines' events reported (the provisional blocks of recent dispatches left out): the
  settled holdings the cost model's abandoned charge reads (``RouteKey.settled``).
- Pure: no I/O; the clock is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from proxy.core.blockhash import ChainMemo, ChainRoot, chain_keys
from proxy.core.kvindex import ExactIndex


class Holdings(Protocol):
    def held_tokens(self, engine: str) -> int | None:
        """Prompt tokens of this request that ``engine`` holds; None: not known here."""
        ...


@dataclass
class PreciseHoldings:
    """A request's holdings over the engines whose exact index is in sync."""

    token_ids: Sequence[int]
    root: ChainRoot
    max_blocks: int
    held: dict[str, int] = field(default_factory=dict)  # engine -> blocks held
    settled: dict[str, int] = field(default_factory=dict)  # engine -> blocks its events reported
    block_sizes: dict[str, int] = field(default_factory=dict)
    _keys: dict[int, list[int]] = field(default_factory=dict)  # block size -> chain keys
    memo: ChainMemo | None = None  # runs of keys hashed for earlier prompts (shared prefixes)

    def keys(self, block_size: int) -> list[int]:
        """The prompt's block keys in ``block_size`` (hashed once per size)."""
        found = self._keys.get(block_size)
        if found is None:
            found = self._keys[block_size] = chain_keys(
                self.token_ids, block_size, self.root, self.max_blocks, self.memo)
        return found

    def add(self, engine: str, index: ExactIndex, block_size: int, now: float) -> None:
        """Count ``engine`` as known: it holds what its index says."""
        self.block_sizes[engine] = block_size
        keys = self.keys(block_size)
        self.held[engine] = held = index.held_blocks(keys, now)
        # Settled blocks are a prefix of the held ones: only the provisional tail needs a look.
        self.settled[engine] = index.settled_blocks(keys[:held]) if held else 0

    def held_tokens(self, engine: str) -> int | None:
        blocks = self.held.get(engine)
        return None if blocks is None else blocks * self.block_sizes[engine]

    def known(self, engines: Sequence[str]) -> dict[str, float]:
        """Held tokens of those ``engines`` this source knows (the rest: the approximate index)."""
        return {e: float(t) for e in engines if (t := self.held_tokens(e)) is not None}

    def known_settled(self, engines: Sequence[str]) -> dict[str, float]:
        """Like ``known``, counting only the blocks the engines' events reported."""
        return {e: float(self.settled.get(e, 0) * self.block_sizes[e])
                for e in engines if e in self.held}

    def new_blocks(self, engine: str) -> list[int]:
        """The prompt's block keys that ``engine`` does not hold (it will store them)."""
        size = self.block_sizes.get(engine)
        if size is None:
            return []
        return self.keys(size)[self.held.get(engine, 0):]
