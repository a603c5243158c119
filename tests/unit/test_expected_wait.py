"""The pool's expected wait (the autoscaling gauge from the cost model): properties."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.config import RoutingConfig
from proxy.core.costmodel import (
    TYPICAL_PROMPT_TOKENS,
    ExpectedTTFT,
    expected_wait,
    typical_prompt,
)
from proxy.core.routeview import EngineView, RouteKey
from proxy.core.routing import RoundRobin

CFG = RoutingConfig()


def idle(name: str, **kw: object) -> EngineView:
    return replace(EngineView(name=name, routable=True, fresh=True, load=0.0, kv_usage=0.0), **kw)


@st.composite
def busy(draw: st.DrawFn, name: str) -> EngineView:
    running = float(draw(st.integers(0, 64)))
    waiting = float(draw(st.integers(0, 32)))
    pending = draw(st.integers(0, 8))
    measured = draw(st.booleans())
    return idle(
        name, load=running + waiting + pending, running=running, waiting=waiting,
        pending=pending, pending_seen=draw(st.integers(0, pending)),
        prefill=float(draw(st.integers(1, 40_000))) if pending else 0.0,
        prefill_tps=draw(st.floats(1e3, 1e5)) if measured else None,
        step_s=draw(st.floats(0.005, 0.2)) if measured else None,
    )


@st.composite
def pools(draw: st.DrawFn) -> list[EngineView]:
    return [draw(busy(f"e{i}")) for i in range(draw(st.integers(1, 6)))]


typicals = st.floats(0.0, 20_000.0)


def test_idle_pool_waits_only_for_its_own_prefill_and_one_step() -> None:
    engines = [idle(f"e{i}") for i in range(4)]
    own = 1024 / CFG.prefill_tokens_per_s + (1 + 1024 / CFG.chunk_tokens) * CFG.decode_step_s
    assert expected_wait(engines, 1024, CFG) == own
    assert own < 0.15  # 0-ish: a tenth of a second at the profile defaults
    assert expected_wait(engines, 0.0, CFG) == CFG.decode_step_s


@settings(max_examples=300, deadline=None)
@given(pools(), typicals, st.integers(1, 64), st.integers(0, 40_000))
def test_more_queued_work_on_every_engine_never_lowers_the_wait(
    engines: list[EngineView], typical: float, more_waiting: int, more_prefill: int
) -> None:
    before = expected_wait(engines, typical, CFG)
    queued = [replace(e, waiting=e.waiting + more_waiting, load=e.load + more_waiting,
                      prefill=e.prefill + more_prefill) for e in engines]
    after = expected_wait(queued, typical, CFG)
    assert before is not None and after is not None
    assert after >= before
    if more_prefill > 0:  # known prompt work queued on every engine: every estimate grows
        assert after > before


@settings(max_examples=200, deadline=None)
@given(pools(), typicals, st.data())
def test_queue_on_one_engine_only_moves_the_wait_up_or_not_at_all(
    engines: list[EngineView], typical: float, data: st.DataObject
) -> None:
    i = data.draw(st.integers(0, len(engines) - 1))
    grown = list(engines)
    grown[i] = replace(engines[i], waiting=engines[i].waiting + 8, load=engines[i].load + 8)
    before, after = expected_wait(engines, typical, CFG), expected_wait(grown, typical, CFG)
    assert before is not None and after is not None and after >= before


@settings(max_examples=200, deadline=None)
@given(pools(), typicals)
def test_the_wait_is_the_best_engines(engines: list[EngineView], typical: float) -> None:
    each = [expected_wait([e], typical, CFG) for e in engines]
    assert expected_wait(engines, typical, CFG) == min(w for w in each if w is not None)


def test_unroutable_engines_do_not_count_and_stale_ones_only_when_nothing_is_fresh() -> None:
    quick, queued = idle("a"), idle("b", waiting=20.0, load=20.0)
    assert expected_wait([replace(quick, routable=False)], 1024, CFG) is None
    assert expected_wait([], 1024, CFG) is None
    only_queued = expected_wait([queued], 1024, CFG)
    assert expected_wait([replace(quick, fresh=False), queued], 1024, CFG) == only_queued
    stale = expected_wait([replace(quick, fresh=False)], 1024, CFG)
    assert stale is not None and not math.isnan(stale)


def test_the_typical_prompt_is_the_cost_models_mean_once_known() -> None:
    policy = ExpectedTTFT(CFG)
    assert typical_prompt(policy) == TYPICAL_PROMPT_TOKENS
    policy.observe(RouteKey(chain=(1, 2), prompt_tokens=3000.0), "e0")
    assert typical_prompt(policy) == 3000.0
    assert typical_prompt(RoundRobin()) == TYPICAL_PROMPT_TOKENS
