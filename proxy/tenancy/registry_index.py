"""The engine registry's index: which registry keys are live, without walking Redis' keyspace.

Rules:
- A registry record lives under its own key with a TTL (``kvproxy:engine:<pool>:<url>``, written
  by sidecars). Finding the records by ``SCAN`` walks every key of the database, the response
  cache's included: at a few hundred thousand keys one walk outlasts the Redis timeout, so
  discovery stops and the timeouts put every Redis feature in its back-off. So each writer also
  enters its key in one sorted set (``<prefix>engine-index``), scored with the key's expiry in
  Redis' own clock (``TIME``: sidecars' and proxies' clocks may differ), and removes it when it
  deregisters. A read takes the members not yet expired, then their values (``MGET``): two round
  trips, whatever the size of the database.
- Writes are one script each (record and index entry together). A write also drops the entries
  expired more than ``_KEEP_EXPIRED_MS`` ago (a sidecar that died mid-heartbeat leaves one).
- Writers without the index (sidecars of an older version) are still found: a reader walks the
  keyspace itself when the index is empty, and otherwise every ``SCAN_EVERY`` reads, page by page
  (each page one round trip under the ordinary timeout, never one long call), and adds what the
  walk found to what the index gives. Records found only by a walk are kept until the next walk.
- Redis' contents are not trusted: a read takes at most ``MAX_RECORDS`` keys from the index and
  from a walk each (a fleet is hundreds of engines; a flooded index or keyspace costs a bounded
  ``MGET``, and a walk stops there).
- The script's text is shared by the proxy's writer (``shared_state.register_engine``) and the
  vLLM sidecar's heartbeat (``engine_sidecar.vllm.registry``), which uses its own client.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

INDEX = "engine-index"  # under the key prefix; not matched by the records' ``engine:*``
_KEEP_EXPIRED_MS = 60_000
SCAN_EVERY = 30  # reads (one a second): a walk every half minute, for writers without the index
SCAN_COUNT = 1000  # keys per SCAN page
MAX_RECORDS = 4096  # registry keys read from the index, and from a walk

# KEYS[1] the record's key, KEYS[2] the index; ARGV[1] the record, ARGV[2] its TTL in ms.
REGISTER = f"""
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - {_KEEP_EXPIRED_MS})
return 1
"""

# KEYS[1] the record's key, KEYS[2] the index.
DEREGISTER = """
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
return 1
"""

# KEYS[1] the index; ARGV[1] the most keys to return: the keys not expired by Redis' clock.
LIVE_KEYS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'LIMIT', 0, tonumber(ARGV[1]))
"""

Run = Callable[[str, Callable[[Any], Awaitable[Any]]], Awaitable[Any]]


async def scan_keys(run: Run, pattern: str) -> list[bytes]:
    """The keys matching ``pattern`` (``MAX_RECORDS`` at most), one ``run`` (one round trip,
    under its timeout) per page."""
    keys: list[bytes] = []
    cursor: int = 0
    while len(keys) < MAX_RECORDS:
        async def page(r: Any, at: int = cursor) -> Any:
            return await r.scan(cursor=at, match=pattern, count=SCAN_COUNT)

        cursor, found = await run("registry_scan", page)
        keys += found
        if not cursor:
            break
    return keys[:MAX_RECORDS]


class IndexedReader:
    """Reads the registry's live keys: the index's, and a walk's every ``SCAN_EVERY`` reads (at
    once while the index is empty), kept between walks."""

    def __init__(self, scan_every: int = SCAN_EVERY) -> None:
        self._scan_every = scan_every
        self._reads = 0
        self._walked: set[bytes] = set()  # found by the last walk

    async def live_keys(self, run: Run, index: str, pattern: str) -> list[bytes]:
        async def indexed(r: Any) -> Any:
            return await r.eval(LIVE_KEYS, 1, index, MAX_RECORDS)

        keys = set(await run("registry_read", indexed))
        if not keys or self._reads % self._scan_every == 0:
            self._walked = set(await scan_keys(run, pattern))
        self._reads += 1
        return sorted(keys | self._walked)
