"""Engine registry in Redis: the sidecar announces its engine under a key with a TTL.

Rules:
- The key lives only while the heartbeat refreshes it, so a dead sidecar disappears by itself;
  a draining one deletes it at once.
- Each write also enters the key in the registry's index, and the deletion takes it out
  (``proxy.tenancy.registry_index``: proxies find the records without walking Redis' keyspace).
- Redis being down is logged and retried, never fatal: routing works from static config too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proxy.tenancy.registry_index import DEREGISTER, INDEX, REGISTER

log = logging.getLogger(__name__)
KEY_PREFIX = "kvproxy:engine:"
INDEX_KEY = "kvproxy:" + INDEX


def registry_key(role: str, engine_url: str) -> str:
    return f"{KEY_PREFIX}{role}:{engine_url}"


async def heartbeat(redis_url: str, key: str, describe: Callable[[], dict[str, object]],
                    ttl_s: float) -> None:
    """Refresh ``key`` every third of the TTL until cancelled; deletes it on the way out."""
    client = aioredis.from_url(redis_url)
    try:
        while True:
            try:
                await client.eval(REGISTER, 2, key, INDEX_KEY, json.dumps(describe()),
                                  max(1, int(ttl_s * 1000)))
            except (RedisError, OSError) as exc:
                log.warning("registry heartbeat failed: %s", exc)
            await asyncio.sleep(ttl_s / 3)
    finally:
        with contextlib.suppress(RedisError, OSError):
            await asyncio.shield(client.eval(DEREGISTER, 2, key, INDEX_KEY))
        await client.aclose()
