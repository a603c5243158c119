"""Rendezvous (highest random weight) ordering of engines for a 64-bit key.

Rules: pure and deterministic; an engine's weight depends only on ``seed``, its name and the key,
so every proxy replica computes the same order, and removing an engine moves only the keys whose
first choice it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

from proxy.core.routeview import mix64


class Rendezvous:
    def __init__(self, seed: int) -> None:
        self._seed = seed.to_bytes(8, "big")
        self._salts: dict[str, int] = {}

    def salt(self, engine: str) -> int:
        salt = self._salts.get(engine)
        if salt is None:
            digest = blake2b(engine.encode(), digest_size=8, key=self._seed).digest()
            salt = self._salts[engine] = int.from_bytes(digest, "big")
        return salt

    def weight(self, key: int, engine: str) -> int:
        return mix64(key ^ self.salt(engine))

    def order(self, key: int, engines: Sequence[str]) -> dict[str, int]:
        """Each engine's place in ``key``'s order (0: its first choice)."""
        ranked = sorted(engines, key=lambda n: (-self.weight(key, n), n))
        return {name: i for i, name in enumerate(ranked)}

    def forget(self, engine: str) -> None:
        self._salts.pop(engine, None)
