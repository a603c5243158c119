"""The response cache with both backends, against a real redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from redisproc import SLOW_OK, RedisFactory, RedisServer

from proxy.core.cache_entry import CachedResponse, replay_sse
from proxy.core.cache_key import CacheConfig
from proxy.core.door_config import RedisConfig
from proxy.tenancy.cache import CacheRequest, ResponseCache, make_cache
from proxy.tenancy.cache_store import MemoryBackend, RedisBackend
from proxy.tenancy.redis_link import RedisLink

CHAT = "/v1/chat/completions"
SECRET = "0123456789abcdef-secret"


def request(tenant: str = "t", content: str = "hi", **extra: object) -> CacheRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}
    return CacheRequest(tenant, "m", CHAT, {**body, **extra})


def answer(content: str) -> bytes:
    return orjson.dumps({
        "id": "x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })  # fmt: skip


async def fill_json(cache: ResponseCache, req: CacheRequest, content: str) -> str:
    lookup = await cache.lookup(req)
    assert lookup.fill is not None
    async with lookup.fill as fill:
        fill.start(200, streamed=False)
        fill.feed(answer(content))
    return lookup.status


@pytest.fixture(params=["memory", "redis"])
async def cache(request: pytest.FixtureRequest, redis_server: RedisServer) -> Any:
    registry = CollectorRegistry()
    if request.param == "memory":
        yield make_cache(CacheConfig(), None, registry=registry)
        return
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK), registry=registry)
    cfg = CacheConfig(backend="redis", secret=SECRET)
    try:
        yield make_cache(cfg, link, registry=registry)
    finally:
        await link.close()


async def test_miss_then_hit_then_bypass(cache: ResponseCache) -> None:
    assert await fill_json(cache, request(), "hello") == "MISS"
    hit = await cache.lookup(request(stream=True))
    assert hit.status == "HIT" and hit.entry is not None
    assert orjson.loads(hit.entry.json_body())["choices"][0]["message"]["content"] == "hello"
    assert b"hello" in replay_sse(hit.entry, include_usage=False)
    sampled = await cache.lookup(request(temperature=0.8))
    assert sampled.status == "BYPASS" and sampled.fill is None
    no_store = CacheRequest("t", "m", CHAT, request().body, "no-store")
    assert (await cache.lookup(no_store)).status == "BYPASS"
    registry = cache.metrics.registry
    for result, count in (("hit", 1), ("miss", 1), ("bypass", 2)):
        assert registry.get_sample_value("kvproxy_cache_lookups_total", {"result": result}) == count


async def test_a_request_cancelled_as_its_answer_ends_still_stores_it(
        cache: ResponseCache) -> None:
    # The client goes away just as the answer completes: the store that follows must not be cut
    # short (a suspending backend's store is shielded; an in-process one never suspends).
    async def leader() -> None:
        lookup = await cache.lookup(request(content="cancelled"))
        assert lookup.fill is not None
        async with lookup.fill as fill:
            fill.start(200, streamed=False)
            fill.feed(answer("kept"))
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # delivered at the next point where the task waits
        await asyncio.sleep(0)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(leader())
    for _ in range(50):  # a shielded store finishes on its own task
        hit = await cache.lookup(request(content="cancelled"))
        if hit.status == "HIT":
            break
        await asyncio.sleep(0.01)
    assert hit.status == "HIT" and hit.entry is not None


async def test_no_cache_refreshes_the_entry(cache: ResponseCache) -> None:
    await fill_json(cache, request(), "old")
    refresh = CacheRequest("t", "m", CHAT, request().body, "no-cache")
    assert await fill_json(cache, refresh, "new") == "BYPASS"
    hit = await cache.lookup(request())
    assert hit.entry is not None and hit.entry.response["choices"][0]["message"]["content"] == "new"


async def test_other_tenants_and_models_miss(cache: ResponseCache) -> None:
    await fill_json(cache, request("a"), "for a")
    assert (await cache.lookup(request("b"))).status == "MISS"
    other_model = CacheRequest("a", "m2", CHAT, {**request().body, "model": "m2"})
    assert (await cache.lookup(other_model)).status == "MISS"


async def test_incomplete_answers_are_not_stored(cache: ResponseCache) -> None:
    lookup = await cache.lookup(request())
    assert lookup.fill is not None
    async with lookup.fill as fill:
        fill.start(200, streamed=True)
        fill.feed(b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"par"}}]}\n\n')
    assert (await cache.lookup(request())).status == "MISS"


@pytest.mark.parametrize("reason", ["abort", "error", "repetition"])
async def test_answers_vllm_ended_without_finishing_are_not_stored(
    cache: ResponseCache, reason: str
) -> None:
    # vLLM's finish reasons besides stop and length: aborted, failed, or cut as a degenerate
    # repetition. None of them is an answer to replay to the next asker.
    lookup = await cache.lookup(request(content=reason))
    assert lookup.fill is not None
    async with lookup.fill as fill:
        fill.start(200, streamed=False)
        fill.feed(answer("half an answer").replace(b'"stop"', f'"{reason}"'.encode()))
    assert (await cache.lookup(request(content=reason))).status == "MISS"
    await fill_json(cache, request(content="stop"), "a whole answer")  # the control: stored
    assert (await cache.lookup(request(content="stop"))).status == "HIT"


async def test_errors_and_exceptions_are_not_stored(cache: ResponseCache) -> None:
    lookup = await cache.lookup(request())
    assert lookup.fill is not None
    async with lookup.fill as fill:
        fill.start(500, streamed=False)
        fill.feed(answer("error page"))
    lookup = await cache.lookup(request())
    assert lookup.status == "MISS" and lookup.fill is not None
    with pytest.raises(RuntimeError):
        async with lookup.fill as fill:
            fill.start(200, streamed=False)
            fill.feed(answer("would be fine"))
            raise RuntimeError("client went away")
    assert (await cache.lookup(request())).status == "MISS"


async def test_single_flight(cache: ResponseCache) -> None:
    leader = await cache.lookup(request())
    assert leader.status == "MISS" and leader.fill is not None
    waiters = [asyncio.create_task(cache.lookup(request())) for _ in range(20)]
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in waiters)
    async with leader.fill as fill:
        fill.start(200, streamed=False)
        fill.feed(answer("shared"))
    results = await asyncio.gather(*waiters)
    assert all(r.status == "HIT" and r.coalesced for r in results)
    registry = cache.metrics.registry
    assert (
        registry.get_sample_value("kvproxy_cache_coalesced_waits_total", {"outcome": "hit"}) == 20
    )


async def test_single_flight_failed_leader_releases_every_waiter(cache: ResponseCache) -> None:
    leader = await cache.lookup(request())
    assert leader.fill is not None
    waiters = [asyncio.create_task(cache.lookup(request())) for _ in range(5)]
    await asyncio.sleep(0.02)
    await leader.fill.finish(completed=False)
    # All of them go to an engine at once; none leads a flight the others would wait for.
    async with asyncio.timeout(1):
        released = await asyncio.gather(*waiters)
    assert all(r.status == "MISS" and r.coalesced and r.fill is not None for r in released)
    registry = cache.metrics.registry
    outcome = {"outcome": "released"}
    assert registry.get_sample_value("kvproxy_cache_coalesced_waits_total", outcome) == 5
    # A request arriving meanwhile starts a flight of its own, which the released ones do not join.
    fresh = await cache.lookup(request())
    assert fresh.status == "MISS" and fresh.fill is not None and not fresh.coalesced
    follower = asyncio.create_task(cache.lookup(request()))
    await asyncio.sleep(0.02)
    assert not follower.done()
    # A released waiter's good answer is stored, though nobody waited on it.
    first = released[0].fill
    assert first is not None
    async with first as fill:
        fill.start(200, streamed=False)
        fill.feed(answer("second try"))
    for other in released[1:]:
        await other.fill.finish(completed=False)  # type: ignore[union-attr]
    await fresh.fill.finish(completed=False)
    assert (await follower).status == "HIT"  # found the released waiter's stored answer
    assert (await cache.lookup(request())).status == "HIT"


async def test_an_answer_too_large_to_store_releases_the_waiters() -> None:
    # Small enough to record as relayed, too large once encoded as an entry: not shared either.
    size = len(answer("large")) + 10
    cache = make_cache(CacheConfig(max_entry_bytes=size), None)
    leader = await cache.lookup(request())
    assert leader.fill is not None
    waiters = [asyncio.create_task(cache.lookup(request())) for _ in range(3)]
    await asyncio.sleep(0.02)
    async with leader.fill as fill:
        fill.start(200, streamed=False)
        fill.feed(answer("large"))
    released = await asyncio.gather(*waiters)
    assert all(r.status == "MISS" and r.fill is not None for r in released)
    registry = cache.metrics.registry
    assert registry.get_sample_value("kvproxy_cache_stores_total", {"outcome": "too_large"}) == 1
    for r in released:
        await r.fill.finish(completed=False)  # type: ignore[union-attr]


async def test_a_discarded_answer_releases_the_waiters(cache: ResponseCache) -> None:
    # Served by another pool (tiering): complete, but not the answer for the model asked for.
    leader = await cache.lookup(request())
    assert leader.fill is not None
    waiters = [asyncio.create_task(cache.lookup(request())) for _ in range(3)]
    await asyncio.sleep(0.02)
    leader.fill.discard()
    async with leader.fill as fill:
        fill.start(200, streamed=False)
        fill.feed(answer("from the draft"))
    released = await asyncio.gather(*waiters)
    assert [(r.status, r.fill is not None) for r in released] == [("MISS", True)] * 3
    for r in released:
        await r.fill.finish(completed=False)  # type: ignore[union-attr]
    assert (await cache.lookup(request())).status == "MISS"


async def test_waiters_share_an_answer_the_backend_failed_to_store(
    redis_factory: RedisFactory,
) -> None:
    server = redis_factory.start()
    link = RedisLink(RedisConfig(url=server.url, op_timeout_s=0.3, retry_after_failure_s=0.3))
    cache = make_cache(CacheConfig(backend="redis", secret=SECRET), link)
    try:
        leader = await cache.lookup(request())
        assert leader.fill is not None
        waiters = [asyncio.create_task(cache.lookup(request())) for _ in range(3)]
        await asyncio.sleep(0.02)
        server.pause()  # the store times out; the answer is good all the same
        async with leader.fill as fill:
            fill.start(200, streamed=False)
            fill.feed(answer("shared"))
        assert [r.status for r in await asyncio.gather(*waiters)] == ["HIT"] * 3
        registry = cache.metrics.registry
        assert registry.get_sample_value("kvproxy_cache_errors_total", {"op": "set"}) == 1
    finally:
        server.resume()
        await link.close()


async def test_single_flight_timeout() -> None:
    cache = make_cache(CacheConfig(single_flight_timeout_s=0.2), None)
    leader = await cache.lookup(request())
    follower = await cache.lookup(request())
    assert follower.status == "MISS" and follower.fill is None  # waited, then went alone
    assert leader.fill is not None
    await leader.fill.finish(completed=False)


def test_memory_backend_bounds() -> None:
    now = [0.0]
    backend = MemoryBackend(max_entries=2, max_bytes=10, clock=lambda: now[0])

    async def scenario() -> None:
        await backend.set("a", b"1234", 10)
        await backend.set("b", b"1234", 10)
        assert await backend.get("a") == b"1234"  # a is now most recent
        await backend.set("c", b"1234", 10)  # evicts b (LRU)
        assert await backend.get("b") is None
        await backend.set("d", b"12345678", 10)  # over max_bytes together: evicts a
        assert await backend.get("a") is None and await backend.get("d") == b"12345678"
        now[0] = 11
        assert await backend.get("d") is None  # expired
        await backend.set("huge", b"x" * 11, 10)
        assert await backend.get("huge") is None

    asyncio.run(scenario())


async def test_redis_garbage_is_a_miss(redis_server: RedisServer) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    cache = make_cache(CacheConfig(backend="redis", secret=SECRET), link)
    try:
        key = cache.key(request())
        await link.client.set(link.key("cache", key), b"\x00garbage")
        lookup = await cache.lookup(request())
        assert lookup.status == "MISS"
        registry = cache.metrics.registry
        assert registry.get_sample_value("kvproxy_cache_errors_total", {"op": "decode"}) == 1
        await lookup.fill.finish(completed=False)  # type: ignore[union-attr]
        # A wrong type under the key (someone else's data) is also a miss.
        await link.client.delete(link.key("cache", key))
        await link.client.lpush(link.key("cache", key), b"x")
        assert (await cache.lookup(request())).status == "MISS"
    finally:
        await link.close()


async def test_redis_ttl(redis_server: RedisServer) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    cache = make_cache(CacheConfig(backend="redis", secret=SECRET, ttl_s=7), link)
    try:
        await fill_json(cache, request(), "x")
        ttl = await link.client.pttl(link.key("cache", cache.key(request())))
        assert 0 < ttl <= 7000
    finally:
        await link.close()


async def test_redis_down_or_frozen_is_a_miss(redis_factory: RedisFactory) -> None:
    server = redis_factory.start()
    link = RedisLink(RedisConfig(url=server.url, op_timeout_s=0.5, retry_after_failure_s=0.5))
    cache = make_cache(CacheConfig(backend="redis", secret=SECRET), link)
    try:
        await fill_json(cache, request(), "cached")
        server.pause()
        lookup = await cache.lookup(request())  # times out: a miss, not an error
        assert lookup.status == "MISS" and lookup.fill is not None
        await lookup.fill.finish(completed=False)
        server.resume()
        server.stop()
        for _ in range(3):
            lookup = await cache.lookup(request())
            assert lookup.status == "MISS" and lookup.fill is not None
            async with lookup.fill as fill:
                fill.start(200, streamed=False)
                fill.feed(answer("x"))
        registry = cache.metrics.registry
        assert registry.get_sample_value("kvproxy_cache_errors_total", {"op": "get"}) >= 3
        assert isinstance(cache.backend, RedisBackend)
    finally:
        await link.close()


async def test_a_stream_without_usage_cannot_answer_a_client_that_wants_usage(
    cache: ResponseCache,
) -> None:
    lookup = await cache.lookup(request(stream=True))
    assert lookup.fill is not None
    async with lookup.fill as fill:
        fill.start(200, streamed=True)
        chunk = {"id": "x", "choices": [{"index": 0, "delta": {"content": "hi"},
                                         "finish_reason": "stop"}]}  # fmt: skip
        fill.feed(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
    assert (await cache.lookup(request(stream=True))).status == "HIT"
    usage = {"include_usage": True}
    for refresher in (request(), request(stream=True, stream_options=usage)):
        refresh = await cache.lookup(refresher)
        assert refresh.status == "MISS" and refresh.fill is not None
        await refresh.fill.finish(completed=False)
    await fill_json(cache, request(), "with usage")
    assert (await cache.lookup(request(stream=True, stream_options=usage))).status == "HIT"


async def test_a_stored_value_larger_than_any_entry_is_refused_without_reading_it_whole(
    redis_server: RedisServer,
) -> None:
    # Another writer put 2 MB under a tenant's key; the proxy stores at most max_entry_bytes
    # (here 64 KB): the read takes no more than that, and the request is a miss.
    registry = CollectorRegistry()
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK), registry=registry)
    cache = make_cache(CacheConfig(backend="redis", secret=SECRET, max_entry_bytes=65536), link,
                       registry=registry)
    try:
        req = request(content="big")
        assert await fill_json(cache, req, "small") == "MISS"
        assert (await cache.lookup(req)).status == "HIT"
        name = link.key("cache", cache.key(req))
        huge = CachedResponse("t", "m", True, orjson.loads(answer("x" * 2_000_000)))
        await link.client.set(name, huge.encode())  # a valid entry, but no proxy stores it
        assert (await cache.lookup(req)).status == "MISS"
        errors = registry.get_sample_value("kvproxy_cache_errors_total", {"op": "decode"})
        assert errors == 1
        assert isinstance(cache.backend, RedisBackend)
        assert await cache.backend.get("never-stored") is None
    finally:
        await link.close()


async def test_a_json_answer_a_stream_cannot_carry_answers_json_clients_only(
    cache: ResponseCache,
) -> None:
    lookup = await cache.lookup(request())
    assert lookup.fill is not None
    doc = orjson.loads(answer("tier"))
    doc["service_tier"] = "default"  # no streamed chunk has this field
    async with lookup.fill as fill:
        fill.start(200, streamed=False)
        fill.feed(orjson.dumps(doc))
    assert (await cache.lookup(request())).status == "HIT"
    stream = await cache.lookup(request(stream=True))
    assert stream.status == "MISS" and stream.fill is not None
    await stream.fill.finish(completed=False)
    assert (await cache.lookup(request())).status == "HIT"  # the JSON entry is kept
