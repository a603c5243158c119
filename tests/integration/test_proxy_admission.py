"""Admission with live telemetry: shedding by class under KV pressure, and degrading to draft."""

from __future__ import annotations

import asyncio

import openai
import pytest

from proxy.core.door_config import LimitsConfig

from .stack import ALIAS, DRAFT_MODEL, TARGET_MODEL, Stack, StackFactory, chat_body


async def _heat(stack: Stack, *names: str, usage: float = 0.93) -> None:
    """``names`` report ``usage`` of their KV cache, and the proxy has seen it."""
    for name in names:
        await stack.faults(name, metric_overrides={"vllm:kv_cache_usage_perc": usage})

    async def seen_hot() -> bool:
        rows = await stack.admin()
        return all(rows[n]["snapshot"]["kv_usage"] == pytest.approx(usage) for n in names)

    await stack.wait_for(seen_hot)


async def test_sheddable_shed_critical_served_under_kv_pressure(stack: Stack) -> None:
    await _heat(stack, "t0", "t1")
    with pytest.raises(openai.APIStatusError) as info:
        await stack.client.chat.completions.create(
            **chat_body("hello"), extra_headers={"X-Priority": "sheddable"}
        )
    err = info.value
    assert err.status_code == 503
    assert int(err.response.headers["Retry-After"]) >= 1
    assert err.response.headers["X-Kvproxy-Shed-Reason"] == "kv_pressure"
    assert err.response.json()["error"]["type"] == "overloaded"

    critical = await stack.client.chat.completions.create(
        **chat_body("hello"), extra_headers={"X-Priority": "critical"}
    )
    assert critical.choices[0].message.content
    # Body priority in vLLM's sense (> 0: sheddable) is honoured as well.
    resp = await stack.post("/v1/chat/completions", chat_body("hi", priority=5))
    assert resp.status == 503
    assert await stack.metric("kvproxy_shed_total", reason="kv_pressure") == 2


async def test_pressure_lifts_after_hysteresis(stack: Stack) -> None:
    await _heat(stack, "t0", "t1")
    resp = await stack.post("/v1/chat/completions", chat_body("x"), **{"X-Priority": "sheddable"})
    assert resp.status == 503
    for name in ("t0", "t1"):
        await stack.clear_faults(name)

    async def admitted() -> bool:
        again = await stack.post(
            "/v1/chat/completions", chat_body("x"), **{"X-Priority": "sheddable"}
        )
        return again.status == 200

    await stack.wait_for(admitted)


async def test_sheddable_tiering_alias_degrades_to_draft(make_stack: StackFactory) -> None:
    stack = await make_stack(targets=2, drafts=1)
    await _heat(stack, "t0", "t1")
    raw = await stack.client.chat.completions.with_raw_response.create(
        **chat_body("hello", model=ALIAS), extra_headers={"X-Priority": "sheddable"}
    )
    assert raw.headers["X-Served-By"] == "draft"
    assert raw.headers["X-Engine"] == "d0"
    assert raw.parse().model == DRAFT_MODEL
    # Critical work on the alias stays on the target pool.
    raw = await stack.client.chat.completions.with_raw_response.create(
        **chat_body("hello", model=ALIAS), extra_headers={"X-Priority": "critical"}
    )
    assert raw.headers["X-Served-By"] == "target"
    # The target model named directly has no fallback: shed.
    resp = await stack.post(
        "/v1/chat/completions", chat_body("hi", model=TARGET_MODEL), **{"X-Priority": "sheddable"}
    )
    assert resp.status == 503
    assert await stack.metric("kvproxy_degraded_total", from_pool="target", to_pool="draft") == 1


async def test_requests_shed_before_any_engine_cost_their_tenant_no_tokens(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(limits=LimitsConfig(enabled=True, tokens_per_min=1000))
    await _heat(stack, "t0", "t1")
    long_prompt = "word " * 1000  # about 1,250 tokens by the estimate, were it charged
    for _ in range(3):
        resp = await stack.post("/v1/chat/completions", chat_body(long_prompt),
                                **{"X-Priority": "sheddable"})
        assert resp.status == 503
    # No engine computed anything for them: the tenant's budget is untouched.
    resp = await stack.post("/v1/chat/completions", chat_body("hi"), **{"X-Priority": "critical"})
    assert resp.status == 200


async def test_a_held_request_does_not_hold_up_an_identical_request_of_another_class(
    make_stack: StackFactory,
) -> None:
    """The response cache makes identical requests wait for the first one's answer; when that
    first one is held by admission, the others are let go at once, not held with it."""
    stack = await make_stack(engine_kw={"time_scale": 1.0})  # streams that stay open a while
    await _heat(stack, "t0", "t1")
    long = {"stream": True, "max_tokens": 300, "ignore_eos": True}
    busy = [asyncio.create_task(stack.post("/v1/chat/completions", chat_body(f"bg {i}", **long),
                                           **{"X-Priority": "critical"})) for i in range(2)]
    try:
        await stack.wait_for(lambda: _inflight(stack))
        same = chat_body("the same question", temperature=0)
        leader = asyncio.create_task(stack.post("/v1/chat/completions", same,
                                                **{"X-Priority": "sheddable"}))
        await stack.wait_for(lambda: _held(stack))
        loop = asyncio.get_running_loop()
        started = loop.time()
        follower = await stack.post("/v1/chat/completions", same, **{"X-Priority": "critical"})
        took = loop.time() - started
        assert follower.status == 200
        assert took < 2.0, f"the critical copy waited {took:.1f}s behind the held one"
        assert (await leader).status in (200, 503)
    finally:
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)


async def _inflight(stack: Stack) -> bool:
    return await stack.metric("kvproxy_inflight_requests") >= 2


async def _held(stack: Stack) -> bool:
    return await stack.metric("kvproxy_held_requests") >= 1


async def test_sheddable_work_behind_held_work_still_moves_down_its_tier_chain(
    make_stack: StackFactory,
) -> None:
    """Standard work held for the target pool's room does not keep sheddable work on a tier
    chain from the draft pool, which admits it now (its deadline too short to be held)."""
    stack = await make_stack(targets=2, drafts=1, engine_kw={"time_scale": 1.0})
    await _heat(stack, "t0", "t1", usage=0.97)  # closed to standard work as well
    long = {"stream": True, "max_tokens": 300, "ignore_eos": True}
    busy = [asyncio.create_task(stack.post("/v1/chat/completions", chat_body(f"bg {i}", **long),
                                           **{"X-Priority": "critical"})) for i in range(2)]
    try:
        await stack.wait_for(lambda: _inflight(stack))
        held = asyncio.create_task(stack.post("/v1/chat/completions", chat_body("std"),
                                              **{"X-Priority": "standard"}))
        await stack.wait_for(lambda: _held(stack))
        resp = await stack.post("/v1/chat/completions", chat_body("shed", model=ALIAS),
                                **{"X-Priority": "sheddable", "X-Request-Timeout": "1"})
        assert resp.status == 200 and resp.headers["X-Served-By"] == "draft"
        assert (await held).status in (200, 503)
    finally:
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
