"""The front door's visit: entered once per request and left exactly once. A request the cache
policy bypasses outright costs no lookup (no key); a miss is stored only when its request
completed; a tenant's stream lease is settled once however the request ended."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from proxy.core.cache_key import KeyMaker
from proxy.core.door_config import DoorConfig, LimitsConfig
from proxy.tenancy.cache import Fill
from proxy.tenancy.frontdoor import FrontDoor, Visit
from proxy.tenancy.ratelimit import RateLimited

CHAT = "/v1/chat/completions"
SSE = (b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
       b'"delta":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}\n\n'
       b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[],'
       b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\ndata: [DONE]\n\n')


class CountingKeys(KeyMaker):
    """The cache's own key maker, counting the keys it makes."""

    def __init__(self) -> None:
        super().__init__(b"k" * 32)
        self.made = 0

    def key(self, *, tenant: str, model: str, endpoint: str, body: Mapping[str, Any]) -> str:
        self.made += 1
        return super().key(tenant=tenant, model=model, endpoint=endpoint, body=body)


def door(limits: LimitsConfig | None = None) -> tuple[FrontDoor, CountingKeys]:
    d = FrontDoor(DoorConfig(limits=limits or LimitsConfig()))
    keys = d.cache._keys = CountingKeys()
    return d, keys


def body(**extra: object) -> dict[str, object]:
    return {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}],
            **extra}


async def enter(d: FrontDoor, b: dict[str, object], cache_control: str | None = None) -> Visit:
    return await d.enter("t", endpoint=CHAT, model="m", body=b, cache_control=cache_control,
                         prompt_chars=2)


def lookups(d: FrontDoor, result: str) -> float:
    return d.cache.metrics.registry.get_sample_value(
        "kvproxy_cache_lookups_total", {"result": result}) or 0.0


def relay(visit: Visit) -> None:
    assert isinstance(visit.recorder, Fill)
    visit.recorder.start(200, streamed=True)
    visit.recorder.feed(SSE)


async def test_a_sampled_request_is_bypassed_without_a_key_or_a_recorder() -> None:
    d, keys = door()
    visit = await enter(d, body(temperature=0.7))
    assert (visit.x_cache, visit.entry, visit.recorder) == ("BYPASS", None, None)
    assert keys.made == 0
    assert lookups(d, "bypass") == 1.0
    await d.leave(visit, completed=True)


async def test_a_write_only_request_still_gets_its_key_and_fill() -> None:
    d, keys = door()
    visit = await enter(d, body(temperature=0), cache_control="no-cache")
    assert visit.x_cache == "BYPASS" and isinstance(visit.recorder, Fill)
    assert keys.made == 1
    relay(visit)
    await d.leave(visit, completed=True)
    again = await enter(d, body(temperature=0))
    assert again.x_cache == "HIT" and again.entry is not None
    await d.leave(again, completed=True)


@pytest.mark.parametrize("completed", [True, False])
async def test_a_miss_is_stored_only_when_its_request_completed(completed: bool) -> None:
    d, _ = door()
    visit = await enter(d, body(temperature=0))
    assert visit.x_cache == "MISS"
    relay(visit)
    await d.leave(visit, completed=completed)
    again = await enter(d, body(temperature=0))
    assert again.x_cache == ("HIT" if completed else "MISS")
    await d.leave(again, completed=False)


async def test_a_stream_lease_is_settled_once_however_the_request_ended() -> None:
    d, _ = door(LimitsConfig(enabled=True, concurrent_streams=1))
    visit = await enter(d, body(temperature=0.7))
    with pytest.raises(RateLimited):
        await enter(d, body(temperature=0.7))  # the tenant's one stream is taken
    await d.leave(visit, completed=False)
    await d.leave(visit, completed=False)  # a second leave settles nothing more
    second = await enter(d, body(temperature=0.7))  # the stream was given back
    third_refused = False
    try:
        await enter(d, body(temperature=0.7))
    except RateLimited:
        third_refused = True
    assert third_refused  # given back once, not twice
    await d.leave(second, completed=True)
