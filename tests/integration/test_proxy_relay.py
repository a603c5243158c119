"""Streaming and plain answers through the proxy, with the official ``openai`` SDK as the client."""

from __future__ import annotations

import re

from .stack import TARGET_MODEL, Stack, StackFactory


async def test_chat_stream(stack: Stack) -> None:
    stream = await stack.client.chat.completions.create(
        model=TARGET_MODEL,
        messages=[{"role": "user", "content": "Tell me about KV caches."}],
        max_tokens=12,
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert chunks[0].model == TARGET_MODEL


async def test_chat_plain(stack: Stack) -> None:
    raw = await stack.client.chat.completions.with_raw_response.create(
        model=TARGET_MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=6,
        extra_headers={"X-Request-Id": "req-plain-1"},
    )
    answer = raw.parse()
    assert answer.choices[0].message.content
    assert raw.headers["X-Request-Id"] == "req-plain-1"
    assert raw.headers["X-Served-By"] == "target"
    assert raw.headers["X-Engine"] in stack.names
    assert answer.id == "chatcmpl-req-plain-1"  # the engine saw the client's request id


async def test_completions_stream_and_plain(stack: Stack) -> None:
    plain = await stack.client.completions.create(
        model=TARGET_MODEL, prompt="Once upon a time", max_tokens=5
    )
    assert plain.choices[0].text
    stream = await stack.client.completions.create(
        model=TARGET_MODEL, prompt="Once upon a time", max_tokens=5, stream=True
    )
    texts = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(texts).strip()


async def test_stream_bytes_pass_through_unchanged(stack: Stack) -> None:
    """The proxy relays the engine's SSE bytes as they are: same events, same [DONE] ending."""
    body = {
        "model": TARGET_MODEL,
        "prompt": "abc",
        "max_tokens": 6,
        "stream": True,
        "seed": 7,
        "temperature": 0,
    }
    via_proxy = await stack.post("/v1/completions", body, **{"X-Request-Id": "same-id"})
    direct = await stack.http.post(
        stack.engine_url(via_proxy.headers["X-Engine"]) + "/v1/completions",
        json=body,
        headers={"X-Request-Id": "same-id"},
    )
    direct_bytes = await direct.read()
    proxy_bytes = await via_proxy.read()
    assert via_proxy.headers["Content-Type"].startswith("text/event-stream")
    assert proxy_bytes.endswith(b"data: [DONE]\n\n")
    assert _without_created(proxy_bytes) == _without_created(direct_bytes)


def _without_created(sse: bytes) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', sse)


async def test_models_health_ready(make_stack: StackFactory) -> None:
    stack = await make_stack(targets=1, drafts=1)
    models = await stack.client.models.list()
    assert {m.id for m in models.data} == {TARGET_MODEL, "draft-model", "chat"}
    for path in ("/health", "/ready"):
        async with stack.http.get(stack.url + path) as resp:
            assert resp.status == 200
    admin = await stack.admin()
    assert set(admin) == {"t0", "d0"}
    assert admin["d0"]["pool"] == "draft"
    assert admin["t0"]["snapshot"]["block_size"] == 16


async def test_own_metrics_are_kvproxy_only(stack: Stack) -> None:
    await stack.client.chat.completions.create(
        model=TARGET_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    async with stack.http.get(stack.url + "/metrics") as resp:
        text = await resp.text()
    names = {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert names
    assert all(name.startswith("kvproxy_") for name in names), names
    for expected in (
        "kvproxy_requests_total",
        "kvproxy_time_to_first_byte_seconds_bucket",
        "kvproxy_dispatch_seconds_bucket",
        "kvproxy_request_duration_seconds_bucket",
        "kvproxy_scrape_duration_seconds_bucket",
        "kvproxy_engine_kv_usage",
        "kvproxy_engine_snapshot_age_seconds",
        "kvproxy_breaker_state",
    ):
        assert expected in names
    assert await stack.metric("kvproxy_requests_total", status="200", pool="target") == 1
    # The proxy's own part of the request (arrival to dispatch) is inside its first-byte time.
    assert await stack.metric("kvproxy_dispatch_seconds_count", pool="target") == 1
    dispatch = await stack.metric("kvproxy_dispatch_seconds_sum", pool="target")
    first_byte = await stack.metric("kvproxy_time_to_first_byte_seconds_sum", pool="target")
    assert 0.0 < dispatch <= first_byte
