"""Paged KV cache with prefix caching, as vLLM's block pool keeps it.

Rules:
- The cache has ``num_blocks`` blocks of ``block_size`` tokens. A block is *held* while at least one
  request references it (refcount > 0); usage is held blocks over all blocks, as vLLM reports it.
- A full block of a request's tokens gets a chained hash, ``blake2b(parent_hash || token ids)``,
  so a block hash names its whole prefix. Hashed blocks stay in the lookup table after their
  requests release them, and are reused by a later request with the same prefix (a prefix-cache
  hit). A request's ``cache_salt`` changes the root of its chain (vLLM hashes it into the first
  block), so requests with different salts never share a block.
- Free blocks sit in one LRU queue: released blocks are appended (a request's tail first, so its
  head, the most shareable part, is evicted last); allocation takes from the front and evicts the
  block's hash if it had one. A hit on a free cached block takes it out of the queue.
- Pure and synchronous: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

ROOT_HASH = b"kvproxy-sim-root"


def salted_root(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: the plain root, or one keyed by its salt."""
    if not cache_salt:
        return ROOT_HASH
    return hashlib.blake2b(ROOT_HASH + cache_salt.encode(), digest_size=16).digest()


def block_hash(parent: bytes, ids: array[int]) -> bytes:
    return hashlib.blake2b(parent + ids.tobytes(), digest_size=16).digest()


class BlockPool:
    """Block allocator with refcounts, a hash table of cached blocks and an LRU free queue."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.held = 0

    @property
    def usage(self) -> float:
        return self.held / self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def chain(self, ids: array[int], parent: bytes = ROOT_HASH, start_block: int = 0
              ) -> list[bytes]:
        """Hashes of the full blocks of ``ids`` from ``start_block`` on, chained from ``parent``."""
        bs = self.block_size
        hashes: list[bytes] = []
        for i in range(start_block, len(ids) // bs):
            parent = block_hash(parent, ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Cached blocks for the longest prefix of ``hashes`` (not yet referenced)."""
        found: list[int] = []
        if not self.enable_caching:
            return found
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, blocks: list[int]) -> None:
        """Reference blocks found by ``lookup``."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
                self.held += 1
            self._refs[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting least recently freed cached ones; ``None`` if too few."""
        if n > len(self._free):
            return None
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of[b]
            if h is not None:
                self._hash_of[b] = None
                if self._cached.get(h) == b:
                    del self._cached[h]
            self._refs[b] = 1
            out.append(b)
        self.held += n
        return out

    def register(self, block: int, h: bytes) -> None:
        """Mark a just-filled block as holding the prefix named by ``h``."""
        if not self.enable_caching or self._hash_of[block] is not None:
            return
        if h not in self._cached:
            self._cached[h] = block
            self._hash_of[block] = h

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; tail blocks enter the LRU queue first."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self.held -= 1
                if self._hash_of[b] is None:
                    # Uncached blocks carry nothing worth keeping: reuse them first.
                    self._free[b] = None
                    self._free.move_to_end(b, last=False)
                else:
                    self._free[b] = None

    def reset_cache(self) -> None:
        """Forget every cached hash of unreferenced blocks (vLLM's ``/reset_prefix_cache``)."""
        for b in self._free:
            h = self._hash_of[b]
            if h is not None:
                self._hash_of[b] = None
                self._cached.pop(h, None)
