"""Redis client exceptions of unexpected types are Redis failures: back-off, one log line, a miss.

The case that found it: a connection option redis-py took from the URL but its connection class
refuses (``socket_timeot``, a typo) made every new connection a ``TypeError``. The link let it
through: no back-off, a traceback per round from every background loop, and HTTP 500 for every
cacheable request. The config now refuses such a URL; the option is put straight into the pool
here to stand for whatever else redis-py may raise.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest
from proxystack import chat, door_config
from redisproc import SLOW_OK, RedisServer

from proxy.core.cache_key import CacheConfig
from proxy.core.door_config import RedisConfig
from proxy.tenancy.cache import CacheRequest, ResponseCache, make_cache
from proxy.tenancy.redis_link import RedisLink, RedisUnavailable

SECRET = "0123456789abcdef-secret"


def refused_option(link: RedisLink) -> None:
    """Every connection the link's pool makes from now on fails with a TypeError."""
    link.client.connection_pool.connection_kwargs["socket_timeot"] = "1"


def answer() -> bytes:
    return orjson.dumps({
        "id": "x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })  # fmt: skip


def request(content: str = "hi") -> CacheRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}
    return CacheRequest("t", "m", "/v1/chat/completions", body)


async def test_a_type_error_from_the_client_backs_off_with_one_line_and_reads_as_a_miss(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK, retry_after_failure_s=60))
    refused_option(link)
    cache = make_cache(CacheConfig(backend="redis", secret=SECRET), link)
    caplog.set_level(logging.DEBUG)
    try:
        for i in range(20):
            lookup = await cache.lookup(request(f"q{i}"))
            assert lookup.status == "MISS" and lookup.fill is not None
            async with lookup.fill as fill:  # the store fails too: skipped, not raised
                fill.start(200, streamed=False)
                fill.feed(answer())
        assert not link.available
        with pytest.raises(RedisUnavailable) as info:
            await link.run("ping", lambda r: r.ping())
        assert info.value.kind == "backoff"
    finally:
        await link.close()
    errors = link.metrics.errors
    assert errors.labels("cache_get", "error")._value.get() == 1
    assert errors.labels("cache_get", "backoff")._value.get() == 19
    assert errors.labels("cache_set", "backoff")._value.get() == 20
    registry = cache.metrics.registry
    assert registry.get_sample_value("kvproxy_cache_errors_total", {"op": "get"}) == 20
    records = [(r.name, r.levelname, r.getMessage(), r.exc_info) for r in caplog.records]
    assert records == [
        ("kvproxy.redis", "WARNING",
         "redis cache_get failed (error: TypeError); falling back for 60.0 s", None),
    ]  # fmt: skip


async def test_cacheable_requests_are_answered_when_every_redis_connection_fails(
    redis_server: RedisServer,
    make_stack: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    made = RedisLink.__init__

    def init(self: RedisLink, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        refused_option(self)

    monkeypatch.setattr(RedisLink, "__init__", init)
    caplog.set_level(logging.INFO)
    door = door_config(redis_url=redis_server.url, backend="redis",
                       redis={"retry_after_failure_s": 60})  # fmt: skip
    stack = await make_stack(door, engines=1)
    for temperature in (0, 0, 1):
        resp, body = await stack.post(chat("hello", temperature=temperature))
        assert resp.status == 200, body
    assert await stack.metric("kvproxy_cache_errors_total", op="get") >= 1
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    lines = [r.getMessage() for r in caplog.records if r.name == "kvproxy.redis"]
    assert len(lines) == 1 and "TypeError" in lines[0]  # one per back-off episode


class BrokenBackend:
    """A backend with a bug of its own: whatever the link does, the cache must not pass it on."""

    suspends = True

    async def get(self, key: str) -> bytes | None:
        raise KeyError(key)

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        raise KeyError(key)


async def test_a_backend_failing_in_any_way_is_a_miss_and_a_skipped_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = ResponseCache(CacheConfig(secret=SECRET), BrokenBackend())
    lookup = await cache.lookup(request())
    assert lookup.status == "MISS" and lookup.fill is not None
    async with lookup.fill as fill:
        fill.start(200, streamed=False)
        fill.feed(answer())
    registry = cache.metrics.registry
    assert registry.get_sample_value("kvproxy_cache_errors_total", {"op": "get"}) == 1
    assert registry.get_sample_value("kvproxy_cache_errors_total", {"op": "set"}) == 1
    assert [r.exc_info for r in caplog.records if r.name == "kvproxy.cache"] == [None, None]


async def test_more_operations_than_pooled_connections_wait_for_one_and_all_succeed(
    redis_server: RedisServer,
) -> None:
    # A burst past ``max_connections`` is not Redis trouble: nothing fails, no back-off.
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK, max_connections=2))
    try:
        await link.run("set", lambda r: r.set("k", "v"))
        got = await asyncio.gather(*(link.run("get", lambda r: r.get("k")) for _ in range(300)))
        assert got == [b"v"] * 300
        assert link.available
    finally:
        await link.close()
