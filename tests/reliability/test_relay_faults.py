"""Engine faults seen through the proxy: retries, cut streams, disconnects, ejection, staleness."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest
from integration.stack import TARGET_MODEL, Stack, StackFactory, chat_body

from proxy.core.config import TelemetryConfig, UpstreamConfig

SLOW = {"time_scale": 1.0, "stop_len_range": (2000, 2000)}


async def _served_by(stack: Stack, content: str, **headers: str) -> str:
    resp = await stack.post("/v1/chat/completions", chat_body(content), **headers)
    assert resp.status == 200, await resp.text()
    return resp.headers["X-Engine"]


@pytest.mark.parametrize("status", [500, 429])
async def test_retry_on_other_engine_before_first_byte(stack: Stack, status: int) -> None:
    await stack.faults("t0", error_rate=1.0, error_status=status)
    served = [await _served_by(stack, f"prompt number {i}") for i in range(12)]
    assert set(served) == {"t1"}
    assert await stack.metric("kvproxy_retries_total", reason=f"http_{status}") >= 1
    assert await stack.metric("kvproxy_upstream_errors_total", engine="t0") >= 1


async def test_no_retry_after_first_byte(stack: Stack) -> None:
    for name in stack.names:
        await stack.faults(name, reset_after_tokens=2)
    before = {n: (await stack.engine_state(n))["prefix_cache_queries"] for n in stack.names}
    stream = await stack.client.chat.completions.create(
        **chat_body("tell me a long story", max_tokens=50),
        stream=True,
        extra_headers={"X-Request-Id": "cut-1"},
    )
    words: list[str] = []
    with pytest.raises(openai.APIError, match="incomplete"):
        async for chunk in stream:
            words.extend(c.delta.content for c in chunk.choices if c.delta.content)
    assert 1 <= len(words) <= 2  # what the engine sent before it died reached the client
    after = {n: (await stack.engine_state(n))["prefix_cache_queries"] for n in stack.names}
    attempted = [n for n in stack.names if after[n] != before[n]]
    assert len(attempted) == 1  # exactly one engine ever saw the request
    assert await stack.metric("kvproxy_retries_total") == 0
    assert await stack.metric("kvproxy_upstream_errors_total", kind="mid_stream") == 1


async def test_plain_answer_lost_before_its_head_is_retried_once(stack: Stack) -> None:
    """A plain (non-stream) answer is sent all at once, so an engine dying mid-generation has
    sent the client nothing: one retry elsewhere is allowed, and no more."""
    for name in stack.names:
        await stack.faults(name, reset_after_tokens=2)
    resp = await stack.post("/v1/chat/completions", chat_body("x", max_tokens=40))
    assert resp.status == 502
    assert (await resp.json())["error"]["type"] == "upstream_error"
    assert await stack.metric("kvproxy_retries_total") == 1
    await stack.clear_faults("t1")
    await stack.faults("t0", reset_after_tokens=2)
    served = {await _served_by(stack, f"p{i}") for i in range(6)}
    assert served == {"t1"}


async def test_client_disconnect_aborts_engine_request(make_stack: StackFactory) -> None:
    stack = await make_stack(engine_kw=SLOW)
    resp = await stack.http.post(
        stack.url + "/v1/chat/completions",
        json=chat_body("stream forever", max_tokens=2000, stream=True),
        headers={"X-Request-Id": "gone-1"},
    )
    assert resp.status == 200
    for _ in range(6):  # past the first reads: the relay is on its raw path by now
        await resp.content.readany()
    engine = resp.headers["X-Engine"]
    resp.close()
    loop = asyncio.get_running_loop()
    closed_at = loop.time()

    async def aborted() -> bool:
        return "chatcmpl-gone-1" in (await stack.engine_state(engine))["aborted_ids"]

    await stack.wait_for(aborted, timeout_s=10.0)
    # The 2000-token stream would run far longer than this: aborted, not ended.
    assert loop.time() - closed_at < 3.0
    # The stream was on the raw path when the client left (counted as it ends).
    assert await stack.metric("kvproxy_relay_raw_streams_total") == 1


async def test_client_disconnect_aborts_plain_request(make_stack: StackFactory) -> None:
    stack = await make_stack(engine_kw=SLOW)
    task = asyncio.create_task(
        stack.post(
            "/v1/chat/completions", chat_body("long", max_tokens=2000), **{"X-Request-Id": "gone-2"}
        )
    )

    async def running() -> bool:
        states = [await stack.engine_state(n) for n in stack.names]
        return bool(sum(s["running"] for s in states) == 1)

    await stack.wait_for(running)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def aborted() -> bool:
        states = [await stack.engine_state(n) for n in stack.names]
        return any("chatcmpl-gone-2" in s["aborted_ids"] for s in states)

    await stack.wait_for(aborted, timeout_s=2.0)


async def test_failing_engine_is_ejected_and_comes_back(stack: Stack) -> None:
    await stack.faults("t0", error_rate=1.0, error_status=500)

    async def breaker_open() -> bool:
        await _served_by(stack, f"probe {asyncio.get_running_loop().time()}")
        return bool((await stack.admin())["t0"]["breaker"] == "open")

    await stack.wait_for(breaker_open)
    assert {await _served_by(stack, f"q{i}") for i in range(6)} == {"t1"}
    await stack.clear_faults("t0")

    async def breaker_closed() -> bool:
        await _served_by(stack, f"again {asyncio.get_running_loop().time()}")
        return bool((await stack.admin())["t0"]["breaker"] == "closed")

    await stack.wait_for(breaker_closed)


async def test_unscrapable_engine_is_unhealthy_then_recovers(stack: Stack) -> None:
    await stack.faults("t0", metrics_status=500)
    await stack.wait_health("t0", "unhealthy")
    assert {await _served_by(stack, f"q{i}") for i in range(6)} == {"t1"}
    assert await stack.metric("kvproxy_scrape_failures_total", engine="t0", reason="http_500") >= 3
    await stack.clear_faults("t0")
    await stack.wait_health("t0", "healthy")


async def test_frozen_metrics_are_not_believed_and_probed(stack: Stack) -> None:
    """An engine whose /metrics repeats itself although it served requests in between fails its
    scrapes ("frozen") until it leaves service; it is probed again and returns once its metrics
    move."""
    await stack.faults("t0", metrics_frozen=True)
    rows: list[dict[str, object]] = []

    async def t0_out() -> bool:
        await _served_by(stack, f"work {asyncio.get_running_loop().time()}")
        rows.append((await stack.admin())["t0"])
        return rows[-1]["health"] == "unhealthy"

    await stack.wait_for(t0_out)
    assert rows[-1]["routable"] is False
    assert str(rows[-1]["health_reason"]).startswith("frozen metrics")
    assert await stack.metric("kvproxy_scrape_failures_total", engine="t0", reason="frozen") >= 3
    assert await stack.metric("kvproxy_scrape_failures_total", engine="t1", reason="frozen") == 0
    await stack.clear_faults("t0")
    await stack.wait_health("t0", "healthy")


async def test_all_stale_fails_open_for_standard_and_sheds_sheddable(
    make_stack: StackFactory,
) -> None:
    # Scrapes keep failing, but too few to call the engines unhealthy: their snapshots only age.
    stack = await make_stack(
        telemetry=TelemetryConfig(
            interval_s=0.1, timeout_s=0.09, stale_after_s=0.6, unhealthy_after_failures=10_000
        )
    )
    for name in stack.names:
        await stack.faults(name, metrics_status=500)

    async def all_stale() -> bool:
        rows = await stack.admin()
        return all(row["health"] == "stale" for row in rows.values())

    await stack.wait_for(all_stale)
    await _served_by(stack, "standard still served")
    assert await stack.metric("kvproxy_stale_fail_open_total") >= 1
    resp = await stack.post("/v1/chat/completions", chat_body("x"), **{"X-Priority": "sheddable"})
    assert resp.status == 503
    assert resp.headers["X-Kvproxy-Shed-Reason"] == "telemetry_stale"


async def test_stalled_stream_ends_with_error_event(make_stack: StackFactory) -> None:
    stack = await make_stack(
        upstream=UpstreamConfig(connect_timeout_s=1.0, first_byte_timeout_s=2.0, idle_timeout_s=0.3)
    )
    for name in stack.names:
        await stack.faults(name, stall_after_tokens=2, stall_s=5.0)
    resp = await stack.post("/v1/chat/completions", chat_body("stall", max_tokens=30, stream=True))
    events = [e for e in (await resp.read()).split(b"\n\n") if e]
    assert resp.status == 200
    assert len(events) >= 2  # what the engine sent, then our error event instead of [DONE]
    last = orjson.loads(events[-1].removeprefix(b"data: "))
    assert last["error"]["type"] == "timeout"


async def test_header_delay_past_first_byte_timeout_is_504(make_stack: StackFactory) -> None:
    stack = await make_stack(
        upstream=UpstreamConfig(connect_timeout_s=0.2, first_byte_timeout_s=0.3, idle_timeout_s=1.0)
    )
    for name in stack.names:
        await stack.faults(name, header_delay_s=2.0)
    # More timeouts per engine than the breaker's failure threshold.
    for i in range(6):  # the stack's breakers open after 2 failures
        resp = await stack.post(
            "/v1/chat/completions", chat_body(f"slow {i}", model=TARGET_MODEL, stream=True)
        )
        assert resp.status == 504
        assert (await resp.json())["error"]["type"] == "timeout"
    # A slow engine is busy, not broken: the timeouts did not open any breaker.
    engines = await stack.admin()
    assert {e["breaker"] for e in engines.values()} == {"closed"}, engines


async def test_slow_non_streamed_answer_gets_the_response_budget(make_stack: StackFactory) -> None:
    # An engine sends a non-streamed answer only once it is generated: a generation longer than
    # the first-byte timeout is normal there and must not be cut off.
    stack = await make_stack(
        upstream=UpstreamConfig(
            connect_timeout_s=0.2, first_byte_timeout_s=0.3, response_timeout_s=10.0,
            idle_timeout_s=1.0,
        )
    )
    for name in stack.names:
        await stack.faults(name, header_delay_s=1.0)
    resp = await stack.post("/v1/chat/completions", chat_body("slow", model=TARGET_MODEL))
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"]


async def test_non_streamed_answer_past_its_budget_is_504(make_stack: StackFactory) -> None:
    stack = await make_stack(
        upstream=UpstreamConfig(
            connect_timeout_s=1.0, first_byte_timeout_s=5.0, response_timeout_s=0.3,
            idle_timeout_s=5.0,
        )
    )
    for name in stack.names:
        await stack.faults(name, header_delay_s=2.0)
    resp = await stack.post("/v1/chat/completions", chat_body("slow", model=TARGET_MODEL))
    assert resp.status == 504
    assert (await resp.json())["error"]["type"] == "timeout"


async def test_a_pool_with_every_engine_down_says_so(stack: Stack) -> None:
    for name in stack.names:
        await stack.faults(name, metrics_status=500)
    for name in stack.names:
        await stack.wait_health(name, "unhealthy")
    resp = await stack.post("/v1/chat/completions", chat_body("anyone there?"))
    assert resp.status == 503
    error = (await resp.json())["error"]
    assert error["message"] == "no engine of pool target is reachable"
    assert (error["type"], error["code"]) == ("service_unavailable", "no_engine_reachable")
    assert resp.headers["X-Kvproxy-Shed-Reason"] == "no_routable_engine"
    assert "Retry-After" in resp.headers
