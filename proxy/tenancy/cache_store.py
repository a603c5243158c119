"""Where the response cache keeps its entries: in this process, or in Redis shared by replicas.

Rules: a backend stores opaque bytes under a key with a TTL and returns them (or None) unchanged;
it knows nothing of entries, tenants or policy (``proxy.tenancy.cache`` does). The in-process one
is bounded by entry count and total bytes and never awaits; the Redis one may fail or be slow,
which its caller turns into a miss.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from proxy.core.cache_entry import EntryError
from proxy.tenancy.redis_link import RedisLink


class CacheBackend(Protocol):
    # Whether ``get``/``set`` may suspend (wait on I/O): only then is a store shielded from a
    # cancelled request by a task of its own; an in-process store runs to its end regardless.
    suspends: bool

    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, ttl_s: float) -> None: ...


class MemoryBackend:
    """In-process LRU with a TTL per entry, bounded by entry count and total bytes."""

    suspends = False  # never awaits: nothing to shield

    def __init__(
        self, *, max_entries: int, max_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self._clock = clock

    def __len__(self) -> int:
        return len(self._items)

    async def get(self, key: str) -> bytes | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item[0] <= self._clock():
            self._drop(key)
            return None
        self._items.move_to_end(key)
        return item[1]

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        if len(value) > self._max_bytes:
            return
        self._drop(key)
        self._items[key] = (self._clock() + ttl_s, value)
        self._bytes += len(value)
        while len(self._items) > self._max_entries or self._bytes > self._max_bytes:
            self._drop(next(iter(self._items)))

    def _drop(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= len(item[1])


class RedisBackend:
    """Entries as plain Redis strings with a TTL (``SET ... PX``). A read takes at most
    ``max_bytes`` + 1 bytes (``GETRANGE``): an entry larger than any this proxy stores, whoever
    wrote it, is refused without being read whole."""

    suspends = True

    def __init__(self, link: RedisLink, max_bytes: int = 1 << 30) -> None:
        self._link = link
        self._max_bytes = max_bytes

    async def get(self, key: str) -> bytes | None:
        name = self._link.key("cache", key)
        value = await self._link.run("cache_get", lambda r: r.getrange(name, 0, self._max_bytes))
        if not isinstance(value, bytes):
            raise EntryError("unexpected value type")
        if len(value) > self._max_bytes:
            raise EntryError("entry larger than cache.max_entry_bytes")
        return value or None  # a missing key reads as empty

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        ttl_ms = max(1, int(ttl_s * 1000))
        await self._link.run(
            "cache_set", lambda r: r.set(self._link.key("cache", key), value, px=ttl_ms)
        )
