"""Property: over random tenants, models and bodies, no answer is ever served across tenants."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from conftest import StackFactory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxystack import MODEL, OTHER_MODEL, chat, door_config
from redisproc import SLOW_OK, RedisServer

from proxy.core.cache_key import CacheConfig, canonical_body
from proxy.core.door_config import RedisConfig
from proxy.tenancy.cache import CacheRequest, ResponseCache, make_cache
from proxy.tenancy.redis_link import RedisLink

CHAT = "/v1/chat/completions"
TENANTS = st.sampled_from(["acme", "beta", "gamma", "a", "ab", "b"])
MODELS = st.sampled_from(["m", "m2", "chat"])
TEXT = st.text(alphabet="ab ", max_size=4)
BODY = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                 "content": TEXT}), min_size=1, max_size=2),
     "temperature": st.sampled_from([0, 0.0])},
    optional={"max_tokens": st.integers(1, 3), "seed": st.integers(0, 2),
              "stream": st.booleans(), "stop": st.lists(TEXT, max_size=1)},
)  # fmt: skip
REQUEST = st.tuples(TENANTS, MODELS, BODY)


def answer_for(tenant: str, model: str) -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": f"{tenant}/{model}"},
              "finish_reason": "stop"}  # fmt: skip
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return orjson.dumps({"object": "chat.completion", "choices": [choice], "usage": usage})


async def scenario(cache: ResponseCache, requests: list[tuple[str, str, dict[str, Any]]]) -> None:
    stored: dict[tuple[str, str, bytes], str] = {}
    for tenant, model, body in requests:
        req = CacheRequest(tenant, model, CHAT, {**body, "model": model})
        lookup = await cache.lookup(req)
        ident = (tenant, model, canonical_body({**body, "model": model}))
        if lookup.entry is not None:
            # A hit is only ever the answer stored for this very tenant, model and request.
            assert ident in stored
            assert lookup.entry.response["choices"][0]["message"]["content"] == stored[ident]
        else:
            assert ident not in stored
            assert lookup.fill is not None
            async with lookup.fill as fill:
                fill.start(200, streamed=False)
                fill.feed(answer_for(tenant, model))
            stored[ident] = f"{tenant}/{model}"


@settings(max_examples=60, deadline=None)
@given(st.lists(REQUEST, min_size=1, max_size=12))
def test_no_cross_tenant_hit_in_memory(requests: list[tuple[str, str, dict[str, Any]]]) -> None:
    asyncio.run(scenario(make_cache(CacheConfig(), None), requests))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(REQUEST, min_size=1, max_size=12))
def test_no_cross_tenant_hit_in_redis(
    redis_server: RedisServer, requests: list[tuple[str, str, dict[str, Any]]]
) -> None:
    async def run() -> None:
        link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
        try:
            await link.client.flushall()
            cfg = CacheConfig(backend="redis", secret="property-secret-0123")
            await scenario(make_cache(cfg, link), requests)
        finally:
            await link.close()

    asyncio.run(run())


PROXY_REQUEST = st.tuples(
    st.sampled_from(["acme", "beta", "gamma"]),
    st.sampled_from([MODEL, OTHER_MODEL]),
    st.sampled_from(["What is a KV cache?", "Tell me a story."]),
    st.sampled_from([{}, {"max_tokens": 4}, {"seed": 1, "temperature": 0.7}]),
    st.booleans(),
)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(PROXY_REQUEST, min_size=2, max_size=10))
async def test_no_cross_tenant_hit_through_the_proxy(
    make_stack: StackFactory, requests: list[tuple[str, str, str, dict[str, Any], bool]]
) -> None:
    stack = await make_stack(door_config(), engines=1, drafts=1)
    # Every stored answer carries usage (the proxy asks engines for it on streams too), so an
    # entry answers streaming and JSON clients alike.
    stored: set[tuple[str, str, str, str]] = set()
    for tenant, model, question, extra, stream in requests:
        body = {**chat(question, stream=stream), "model": model, **extra}
        resp, _ = await stack.post(body, tenant=tenant)
        assert resp.status == 200
        ident = (tenant, model, question, repr(sorted(extra.items())))
        assert resp.headers["X-Cache"] == ("HIT" if ident in stored else "MISS")
        stored.add(ident)
