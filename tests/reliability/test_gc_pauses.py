"""The garbage collector's pauses are exported by a real proxy, and a served process tunes it."""

from __future__ import annotations

import gc

import aiohttp

from proxy.server.lifecycle import settle_heap

from .rogue import RogueEngine
from .shell import proxy_for

PAUSE = "kvproxy_gc_pause_seconds_count"


async def _pause_counts(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(PAUSE + "{"):
            generation = line.split('generation="', 1)[1].split('"', 1)[0]
            counts[generation] = float(line.rsplit(" ", 1)[1])
    return counts


async def test_a_forced_collection_shows_in_metrics_by_generation(rogue: RogueEngine) -> None:
    async with proxy_for(rogue) as proxy:
        before = await _pause_counts(proxy.url)
        gc.collect(2)
        gc.collect(0)
        after = await _pause_counts(proxy.url)
    assert after["2"] >= before.get("2", 0.0) + 1
    assert after["0"] >= before.get("0", 0.0) + 1
    assert set(after) == {"0", "1", "2"}


async def test_a_stopped_proxy_leaves_no_collector_callback(rogue: RogueEngine) -> None:
    callbacks = list(gc.callbacks)
    async with proxy_for(rogue):
        assert len(gc.callbacks) == len(callbacks) + 1
    assert gc.callbacks == callbacks


def test_settle_heap_freezes_start_up_and_sets_the_young_and_middle_thresholds() -> None:
    thresholds = gc.get_threshold()
    try:
        settle_heap(1234, 56)
        assert gc.get_threshold()[:2] == (1234, 56)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
