"""The pure part of routing decisions serialised between replicas (``proxy.core.claims``)."""

from __future__ import annotations

import math
import random

import pytest

from proxy.core.claims import (
    FORCE_ROUNDS,
    MAX_CANDIDATES,
    Claimable,
    ClaimLedger,
    amount,
    choose_claimed,
    claimables,
    parse_reply,
    reorder,
)
from proxy.core.config import RoutingConfig
from proxy.core.costmodel import Estimate, ExpectedTTFT, estimate, queue_step
from proxy.core.routeview import EngineView, RouteKey


def view(name: str, **kw: float) -> EngineView:
    return EngineView(name, routable=True, fresh=True, load=kw.pop("load", 0.0), kv_usage=0.1,
                      **kw)  # type: ignore[arg-type]


def test_the_cost_is_linear_in_the_prompt_tokens_queued_ahead() -> None:
    # What the script relies on: cost(backlog + r) == cost(backlog) + slope * r.
    cfg = RoutingConfig()
    key = RouteKey(chain=(1,), prompt_tokens=2000.0)
    rng = random.Random(1)
    for _ in range(50):
        kw = {"prefill": rng.uniform(1, 20_000), "running": rng.uniform(0, 50),
              "load": rng.uniform(0, 60), "waiting": rng.uniform(0, 5)}
        if rng.random() < 0.5:
            kw |= {"prefill_tps": rng.uniform(1e3, 5e4), "step_s": rng.uniform(0.005, 0.05)}
        extra = rng.uniform(0, 10_000)
        base = view("e", **kw)
        more = view("e", **(kw | {"prefill": kw["prefill"] + extra}))
        a = estimate(base, 0.0, key, 1000.0, cfg, delayed=1.7).cost_s
        b = estimate(more, 0.0, key, 1000.0, cfg, delayed=1.7).cost_s
        assert b == pytest.approx(a + queue_step(base, 1.0, cfg) * extra, rel=1e-9)


def test_candidates_keep_the_cache_hit_rule_and_leave_out_the_peers_backlog() -> None:
    est = [Estimate("a", 0.1, 0.2, 3000.0, 0.5), Estimate("b", 0.1, 0.2, 2950.0, 0.6),
           Estimate("c", 0.0, 0.1, 0.0, 0.3)]
    out = claimables(est, ("a", "b", "c"), slopes={"a": 1e-4, "b": 2e-4, "c": 1e-4},
                     remote={"b": 1000.0}, prompt_tokens=4000.0, held_slack=100.0)
    # c holds 3000 tokens less than the pick: never a candidate, whatever its load.
    assert [c.name for c in out] == ["a", "b"]
    assert out[1].cost_s == pytest.approx(0.6 - 2e-4 * 1000.0)
    assert out[0].tokens == 1000.0 and out[1].tokens == 1050.0


def test_candidates_are_bounded() -> None:
    est = [Estimate(f"e{i}", 0.0, 0.1, 0.0, 0.1) for i in range(100)]
    out = claimables(est, [e.name for e in est], slopes={e.name: 1e-4 for e in est}, remote={},
                     prompt_tokens=100.0, held_slack=0.0)
    assert len(out) == MAX_CANDIDATES


def test_the_pick_is_the_cost_models_choice_on_the_totals() -> None:
    cands = [Claimable("a", 1.0, 1e-3, 0.0, 100.0), Claimable("b", 1.0, 1e-3, 0.0, 100.0)]
    assert choose_claimed(cands, [0.0, 0.0], 0.1) == 0  # a tie: the local ranking's order
    assert choose_claimed(cands, [500.0, 0.0], 0.1) == 1  # a's peers' claims move it
    # Within the tolerance, the engine holding more of the prompt stays the pick.
    held = [Claimable("a", 1.0, 1e-3, 64.0, 100.0), Claimable("b", 1.0, 1e-3, 0.0, 100.0)]
    assert choose_claimed(held, [50.0, 0.0], 0.1) == 0
    assert choose_claimed(held, [500.0, 0.0], 0.1) == 1


def test_a_replica_alone_with_claims_off_ranks_as_before() -> None:
    views = [view(f"e{i}", prefill=float(i * 100)) for i in range(4)]
    key = RouteKey(chain=(9,), prompt_tokens=1000.0)
    one, two = ExpectedTTFT(RoutingConfig()), ExpectedTTFT(RoutingConfig())
    decision = two.decide(key, views, claims=True)
    assert one.rank(key, views) == decision.ranked == decision.plain
    assert decision.claimable[0].name == decision.ranked[0]


@pytest.mark.parametrize("raw", ["nan", "-1", "inf", "1e300", "abc", "9" * 40, None, 5, b"x"])
def test_hostile_figures_are_ignored(raw: object) -> None:
    assert amount(raw) is None


def test_readable_figures_are_read() -> None:
    assert amount(b"1500.5") == 1500.5 and amount("0") == 0.0


def test_replies_out_of_bounds_are_refused() -> None:
    assert parse_reply([1, 1, b"0", 2], 2) == 1
    for raw in ([0], [1, 2, b"0", 1], [1, -1], [1, True], "x", None, [1, 1.0]):
        assert parse_reply(raw, 2) is None


def test_reorder_keeps_the_retry_order() -> None:
    assert reorder(("a", "b", "c"), "c") == ("c", "a", "b")


def test_the_ledger_moves_claims_to_the_backlog_by_deltas() -> None:
    ledger = ClaimLedger()
    ledger.granted("a", 1000.0)
    writes = ledger.plan({"a": 0.0, "b": 300.0})
    assert not writes.absolute and dict(writes.values) == {"a": -1000.0, "b": 300.0}
    ledger.applied(writes)
    assert ledger.claimed == {"b": 300.0}
    assert not ledger.plan({"b": 300.0}).values  # nothing to write


def test_an_unsure_ledger_writes_absolute_figures_when_nothing_is_in_flight() -> None:
    ledger = ClaimLedger()
    ledger.granted("a", 1000.0)
    ledger.lost()
    ledger.outstanding = 1
    assert not ledger.plan({"a": 10.0}).absolute  # a decision in flight could be overwritten
    ledger.outstanding = 0
    writes = ledger.plan({"a": 10.0})
    assert writes.absolute and dict(writes.values) == {"a": 10.0}
    ledger.applied(writes)
    assert not ledger.dirty and ledger.claimed == {"a": 10.0}


def test_an_unsure_ledger_writes_absolute_figures_at_last_under_load() -> None:
    ledger = ClaimLedger(outstanding=1)
    ledger.lost()
    plans = [ledger.plan({"a": 1.0}) for _ in range(FORCE_ROUNDS)]
    assert [p.absolute for p in plans] == [False] * (FORCE_ROUNDS - 1) + [True]
    assert math.isclose(plans[-1].values["a"], 1.0)
