"""How many of a request's prompt tokens each engine already holds in its KV cache.

Rules:
- ``Holdings`` is the one question routing asks, whatever answers it: ``held_tokens(engine)`` is
  the number of the request's prompt tokens the engine holds as a cached prefix, or ``None`` when
  this source does not know the engine (routing then asks the approximate index).
- ``PreciseHoldings`` answers from the exact indexes (``kvindex``) of the engines whose KV events
  are in sync: the prompt's token ids are hashed as vLLM hashes them (``blockhash.chain_keys``,
  the request's ``cache_salt`` on the first block) in each engine's block size, and the longest
  prefix the engine holds counts ``blocks x block_size`` tokens. Engines out of sync are unknown.
- ``as_chain_blocks`` turns held tokens into blocks of the approximate prefix chain (characters),
  for a policy that counts in those; the request's own characters-per-token ratio converts.
- Pure: no I/O; the clock is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from proxy.core.blockhash import ChainRoot, chain_keys
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
    block_sizes: dict[str, int] = field(default_factory=dict)
    _keys: dict[int, list[int]] = field(default_factory=dict)  # block size -> chain keys

    def keys(self, block_size: int) -> list[int]:
        """The prompt's block keys in ``block_size`` (hashed once per size)."""
        found = self._keys.get(block_size)
        if found is None:
            found = self._keys[block_size] = chain_keys(
                self.token_ids, block_size, self.root, self.max_blocks)
        return found

    def add(self, engine: str, index: ExactIndex, block_size: int, now: float) -> None:
        """Count ``engine`` as known: it holds what its index says."""
        self.block_sizes[engine] = block_size
        self.held[engine] = index.held_blocks(self.keys(block_size), now)

    def held_tokens(self, engine: str) -> int | None:
        blocks = self.held.get(engine)
        return None if blocks is None else blocks * self.block_sizes[engine]

    def chain_blocks(self, engines: Sequence[str], prompt_chars: int, block_chars: int,
                     chain_len: int) -> Mapping[str, int]:
        """``as_chain_blocks`` of this request (its own characters-per-token ratio)."""
        return as_chain_blocks(self, engines, prompt_chars=prompt_chars,
                               prompt_tokens=len(self.token_ids), block_chars=block_chars,
                               chain_len=chain_len)

    def new_blocks(self, engine: str) -> list[int]:
        """The prompt's block keys that ``engine`` does not hold (it will store them)."""
        size = self.block_sizes.get(engine)
        if size is None:
            return []
        return self.keys(size)[self.held.get(engine, 0):]


def as_chain_blocks(holdings: Holdings, engines: Sequence[str], *, prompt_chars: int,
                    prompt_tokens: int, block_chars: int, chain_len: int) -> Mapping[str, int]:
    """Held tokens of the known ``engines`` in blocks of the character prefix chain."""
    out: dict[str, int] = {}
    chars_per_token = prompt_chars / max(1, prompt_tokens)
    for engine in engines:
        tokens = holdings.held_tokens(engine)
        if tokens is not None:
            out[engine] = min(chain_len, int(tokens * chars_per_token) // block_chars)
    return out
