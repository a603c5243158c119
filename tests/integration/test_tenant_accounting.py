"""Per-tenant accounting from the engines' own usage, seen through the OpenAI SDK: streams get
their usage asked for (and stripped again when the client did not ask), plain answers too."""

from __future__ import annotations

import openai

from proxy.core.cache_key import CacheConfig
from proxy.core.door_config import AuthConfig, LimitsConfig, TenantConfig

from .stack import TARGET_MODEL, Stack, StackFactory

KEY = "sk-acme-0123456789"
MESSAGES = [{"role": "user", "content": "Count the tokens of this request, please."}]


async def _stack(make_stack: StackFactory) -> Stack:
    auth = AuthConfig(tenants=(TenantConfig("acme", keys=(KEY,)),))
    return await make_stack(targets=1, auth=auth)


async def test_usage_is_counted_per_tenant_and_stripped_when_not_asked(
    make_stack: StackFactory,
) -> None:
    stack = await _stack(make_stack)
    acme = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0)
    try:
        plain_chunks = [
            c
            async for c in await acme.chat.completions.create(
                model=TARGET_MODEL, messages=MESSAGES, max_tokens=8, stream=True
            )
        ]
        usage_chunks = [
            c
            async for c in await acme.chat.completions.create(
                model=TARGET_MODEL, messages=MESSAGES, max_tokens=8, stream=True,
                stream_options={"include_usage": True},
            )
        ]  # fmt: skip
        whole = await acme.chat.completions.create(
            model=TARGET_MODEL, messages=MESSAGES, max_tokens=8
        )
    finally:
        await acme.close()

    # Not asked: no usage chunk reaches the client, and the answer itself is whole.
    assert all(c.usage is None and c.choices for c in plain_chunks)
    assert plain_chunks[-1].choices[0].finish_reason in ("stop", "length")
    # Asked: exactly one, last, with no choices.
    assert [c.usage is not None for c in usage_chunks].count(True) == 1
    last = usage_chunks[-1]
    assert last.usage is not None and last.choices == []
    assert whole.usage is not None

    prompt = whole.usage.prompt_tokens
    assert last.usage.prompt_tokens == prompt
    labels = {"tenant": "acme", "pool": "target"}
    assert await stack.metric("kvproxy_tenant_requests_total", status="200", **labels) == 3
    assert await stack.metric("kvproxy_tenant_tokens_total", kind="prompt", **labels) == 3 * prompt
    # The stripped usage counted too: at least one token more than the two answers show.
    shown = last.usage.completion_tokens + whole.usage.completion_tokens
    completion = await stack.metric("kvproxy_tenant_tokens_total", kind="completion", **labels)
    assert completion >= shown + 1
    details = whole.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens else 0
    assert cached > 0, "the repeated prompt is served from the engine's prefix cache"
    assert await stack.metric("kvproxy_tenant_tokens_total", kind="cached", **labels) == cached


async def test_without_a_key_everything_is_the_anonymous_tenant(make_stack: StackFactory) -> None:
    stack = await _stack(make_stack)
    body = {"model": TARGET_MODEL, "messages": MESSAGES, "max_tokens": 4}
    assert (await stack.post("/v1/chat/completions", body)).status == 200
    missing = await stack.post("/v1/chat/completions", {"model": "gpt-9", "messages": MESSAGES})
    assert missing.status == 404
    default = {"tenant": "default"}
    assert await stack.metric("kvproxy_tenant_requests_total", status="200", **default) == 1
    assert await stack.metric("kvproxy_tenant_requests_total", status="404", **default) == 1
    assert await stack.metric("kvproxy_tenant_tokens_total", kind="prompt", **default) > 0
    assert await stack.metric("kvproxy_tenant_requests_total", tenant="acme") == 0


async def test_a_stream_too_long_to_record_is_charged_its_usage_not_an_estimate(
    make_stack: StackFactory,
) -> None:
    # Past cache.max_entry_bytes the recording is dropped, but the relay still read the engine's
    # usage: about 60 tokens charged per stream, where the estimate from ~6 KB of events would
    # put the tenant hundreds of tokens in debt after the first.
    stack = await make_stack(targets=1, limits=LimitsConfig(enabled=True, tokens_per_min=300),
                             cache=CacheConfig(max_entry_bytes=512))
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    try:
        for _ in range(3):
            stream = await client.chat.completions.create(
                model=TARGET_MODEL, messages=MESSAGES, max_tokens=40, stream=True,
                temperature=1.0, extra_body={"ignore_eos": True})
            chunks = [c async for c in stream]
            assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        await client.close()
