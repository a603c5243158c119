"""Client deadlines: ``X-Request-Timeout`` or the body's ``timeout`` end a slow request with a 504
(a plain answer) or an SSE error event (a stream), and the engine aborts the generation."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from .stack import Stack, StackFactory, chat_body

# About 20 tokens a second: a 400-token answer takes far longer than any deadline below.
SLOW = {"time_scale": 0.05}


def _long(**extra: Any) -> dict[str, Any]:
    return chat_body("tell me everything", max_tokens=400, ignore_eos=True, **extra)


@pytest.fixture
async def slow(make_stack: StackFactory) -> Stack:
    return await make_stack(targets=1, engine_kw=SLOW)


async def _aborted(stack: Stack, request_id: str) -> None:
    async def seen() -> bool:
        return request_id in (await stack.engine_state("t0"))["aborted_request_ids"]

    await stack.wait_for(seen, what=f"engine aborts {request_id}")


async def test_plain_request_past_its_deadline_is_504(slow: Stack) -> None:
    resp = await slow.post(
        "/v1/chat/completions", _long(), **{"X-Request-Timeout": "0.5", "X-Request-Id": "dl-1"}
    )
    assert resp.status == 504
    error = (await resp.json())["error"]
    assert "deadline of 0.5 s" in error["message"]
    await _aborted(slow, "dl-1")
    # The body's timeout works the same; the smaller of the two wins.
    resp = await slow.post(
        "/v1/chat/completions",
        _long(timeout=0.3),
        **{"X-Request-Timeout": "30", "X-Request-Id": "dl-2"},
    )
    assert resp.status == 504 and "deadline of 0.3 s" in (await resp.json())["error"]["message"]
    await _aborted(slow, "dl-2")
    # The engine was not at fault: its breaker is not charged for the client's deadlines.
    assert (await slow.admin())["t0"]["breaker"] == "closed"


async def test_stream_past_its_deadline_ends_with_an_error_event(slow: Stack) -> None:
    headers = {"X-Request-Timeout": "1", "X-Request-Id": "dl-3"}
    async with slow.http.post(
        slow.url + "/v1/chat/completions", json=_long(stream=True), headers=headers
    ) as resp:
        assert resp.status == 200
        raw = await resp.read()
    events = [ln[6:] for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
    assert b"[DONE]" not in events
    assert any(b'"content"' in e for e in events[:-1]), "some tokens came before the cut"
    last = orjson.loads(events[-1])
    assert last["error"]["type"] == "timeout" and "deadline" in last["error"]["message"]
    await _aborted(slow, "dl-3")


@pytest.mark.parametrize(
    ("headers", "extra", "param"),
    [
        ({"X-Request-Timeout": "soon"}, {}, "X-Request-Timeout"),
        ({"X-Request-Timeout": "-1"}, {}, "X-Request-Timeout"),
        ({"X-Request-Timeout": "inf"}, {}, "X-Request-Timeout"),
        ({}, {"timeout": 0}, "timeout"),
        ({}, {"timeout": "5"}, "timeout"),
    ],
)
async def test_bad_deadlines_are_400_naming_the_source(
    slow: Stack, headers: dict[str, str], extra: dict[str, Any], param: str
) -> None:
    resp = await slow.post("/v1/chat/completions", chat_body("hi", **extra), **headers)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param and param in error["message"].replace("'", "")
