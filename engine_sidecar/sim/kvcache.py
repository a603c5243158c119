"""Paged KV cache with prefix caching, as vLLM's block pool keeps it.

Rules:
- The cache has ``num_blocks`` blocks of ``block_size`` tokens. A block is *held* while at least one
  request references it (refcount > 0); usage is held blocks over all blocks, as vLLM reports it.
- A full block of a request's tokens gets a chained hash of (parent hash, its token ids, extra
  keys), so a block hash names its whole prefix. A request's ``cache_salt`` is an extra key of its
  first block (as in vLLM), so requests with different salts never share a block. The hash is
  vLLM's ``sha256_cbor`` (``blockhash``) when KV events are published, so the events name blocks
  as a real engine would; otherwise a cheaper blake2b chain with the same structure.
- Hashed blocks stay in the lookup table after their requests release them, and are reused by a
  later request with the same prefix (a prefix-cache hit). One block per hash: a block filled with
  a prefix that another block already holds is not cached.
- Free blocks sit in one LRU queue: released blocks are appended (a request's tail first, so its
  head, the most shareable part, is evicted last); allocation takes from the front and evicts the
  block's hash if it had one. A hit on a free cached block takes it out of the queue.
- With events on, every change of the lookup table is recorded as vLLM records it: newly cached
  blocks as ``BlockStored`` (one per run of consecutive blocks of a request), each evicted hash as
  ``BlockRemoved``, a reset as ``AllBlocksCleared``; ``take_events`` hands them over once per step.
  So the events are an exact log of what the cache can hit.
- Pure and synchronous: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from engine_sidecar.sim.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from proxy.core.blockhash import (
    PLAIN_ROOT,
    ChainRoot,
    ExtraKeys,
    event_extra_keys,
    hash_block_tokens,
)

ROOT_HASH = b"kvproxy-sim-root"
Hasher = Callable[[bytes | None, Sequence[int], ExtraKeys], bytes]


def fast_block_hash(parent: bytes | None, ids: Sequence[int], extra_keys: ExtraKeys) -> bytes:
    """blake2b over the parent hash and the ids' machine bytes (``ids`` is an ``array``)."""
    if parent is None:
        parent = ROOT_HASH
        if extra_keys:
            salt = "".join(value for _, value in extra_keys)
            parent = hashlib.blake2b(ROOT_HASH + salt.encode(), digest_size=16).digest()
    data = ids.tobytes() if isinstance(ids, array) else array("I", ids).tobytes()
    return hashlib.blake2b(parent + data, digest_size=16).digest()


class BlockPool:
    """Block allocator with refcounts, a hash table of cached blocks and an LRU free queue."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, *,
                 vllm_hashes: bool = False, record_events: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.held = 0
        self._hash: Hasher = hash_block_tokens if vllm_hashes else fast_block_hash
        self._events: list[KvEvent] | None = [] if record_events else None

    @property
    def usage(self) -> float:
        return self.held / self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def chain(self, ids: array[int], parent: bytes | ChainRoot = PLAIN_ROOT, start_block: int = 0
              ) -> list[bytes]:
        """Hashes of the full blocks of ``ids`` from ``start_block`` on, chained from ``parent``:
        the previous block's hash, or the request's root when ``start_block`` is 0."""
        bs = self.block_size
        hashes: list[bytes] = []
        prev, extra = (None, parent.extra_keys) if isinstance(parent, ChainRoot) else (parent, None)
        for i in range(start_block, len(ids) // bs):
            prev = self._hash(prev, ids[i * bs:(i + 1) * bs], extra)
            extra = None
            hashes.append(prev)
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
                    if self._events is not None:
                        self._events.append(BlockRemoved(h))
            self._refs[b] = 1
            out.append(b)
        self.held += n
        return out

    def register(self, block: int, h: bytes) -> bool:
        """Mark a just-filled block as holding the prefix named by ``h``; True if it now does."""
        if not self.enable_caching or self._hash_of[block] is not None:
            return False
        if h in self._cached:
            return False
        self._cached[h] = block
        self._hash_of[block] = h
        return True

    def cache_full_blocks(self, blocks: list[int], hashes: list[bytes], start: int, end: int, *,
                          ids: array[int], root: ChainRoot) -> None:
        """Register a request's just-filled blocks ``start..end-1`` (``ids``: its tokens)."""
        stored = [i for i in range(start, end) if self.register(blocks[i], hashes[i])]
        if self._events is None or not stored:
            return
        run = [stored[0]]
        for i in stored[1:]:
            if i != run[-1] + 1:
                self._events.append(self._stored(run, hashes, ids, root))
                run = []
            run.append(i)
        self._events.append(self._stored(run, hashes, ids, root))

    def _stored(self, run: list[int], hashes: list[bytes], ids: array[int], root: ChainRoot
                ) -> BlockStored:
        bs, first = self.block_size, run[0]
        return BlockStored(
            block_hashes=[hashes[i] for i in run],
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=ids[first * bs:(run[-1] + 1) * bs].tolist(), block_size=bs,
            extra_keys=[event_extra_keys(root.extra_keys) if i == 0 else None for i in run])

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call (none when events are off)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

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

    def reset_cache(self) -> bool:
        """Forget every cached hash (vLLM's ``/reset_prefix_cache``); like vLLM, refused (False)
        while any block is held."""
        if self.held:
            return False
        self._hash_of = [None] * self.num_blocks
        self._cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True
