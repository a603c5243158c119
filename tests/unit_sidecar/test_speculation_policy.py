"""The goodput policy, the cost model and its calibration, the window, the rollout machine."""

import pytest

from engine_sidecar.speculation.cost import StepCost, calibrate, mean_step_time
from engine_sidecar.speculation.policy import (
    Figures,
    PolicySettings,
    PolicyState,
    committed,
    decide,
    estimate_positions,
    extend_positions,
)
from engine_sidecar.speculation.rollout import IllegalTransition, Rollout, RolloutState, may_start
from engine_sidecar.speculation.schedule import k_for_batch, uniform, validate
from engine_sidecar.speculation.window import MetricsWindow, Snapshot

# A 70B-on-one-GPU shape: bandwidth-bound at batch 1, compute-bound with long drafts at 64.
COST = StepCost(fixed_s=0.004, weights_s=0.026, kv_per_seq_s=0.00006,
                compute_per_token_s=0.00013, draft_pass_s=0.002)
HIGH = extend_positions((0.8, 0.64), 8)
LOW = extend_positions((0.3, 0.09), 8)
SETTINGS = PolicySettings(max_k=8, max_batch=256, min_interval_s=60, confirmations=2)


def figures(p, batches, drafts=1000.0):
    return Figures(p, batches, drafts)


def test_step_time_grows_with_batch_and_with_k_once_compute_bound():
    assert COST.step_time(64, 0) > COST.step_time(1, 0)
    assert COST.step_time(1, 2) - COST.step_time(1, 0) == pytest.approx(2 * 0.002)
    assert COST.step_time(64, 8) > COST.step_time(64, 4) + 4 * 0.002


def test_low_load_and_high_acceptance_want_long_drafts_high_load_short_ones():
    settings = PolicySettings(max_k=8, max_batch=256, margin=0.0, confirmations=1,
                              min_interval_s=0)
    d, _ = decide(settings, PolicyState(), COST, figures(HIGH, {1: 1.0, 64: 1.0}),
                  current=uniform(4, 256), now=0.0)
    assert k_for_batch(d.proposed, 1, 8) >= 6
    assert 1 <= k_for_batch(d.proposed, 64, 8) <= 4
    d, _ = decide(settings, PolicyState(), COST, figures(LOW, {64: 1.0}),
                  current=d.proposed, now=0.0)
    assert k_for_batch(d.proposed, 64, 8) <= 2


def test_a_change_needs_margin_confirmations_and_the_minimum_interval():
    state, current = PolicyState(), uniform(4, 256)
    d, state = decide(SETTINGS, state, COST, figures(LOW, {64: 1.0}), current=current, now=0)
    assert d.action == "wait" and "confirmation 1/2" in d.reason and d.predicted_gain > 0.05
    d, state = decide(SETTINGS, state, COST, figures(LOW, {64: 1.0}), current=current, now=10)
    assert d.action == "change"
    state = committed(state, 10)
    d, state = decide(SETTINGS, state, COST, figures(LOW, {64: 1.0}), current=current, now=20)
    d, state = decide(SETTINGS, state, COST, figures(LOW, {64: 1.0}), current=current, now=30)
    assert d.action == "wait" and "too recent" in d.reason


def test_small_gains_are_kept_and_unmeasured_acceptance_waits():
    d, _ = decide(SETTINGS, PolicyState(), COST, figures(HIGH, {64: 1.0}),
                  current=validate([[1, 256, 3]], max_k=8), now=0)
    assert d.action == "keep" and d.predicted_gain <= 0.05
    d, _ = decide(SETTINGS, PolicyState(), COST, figures(HIGH, {64: 1.0}, drafts=3),
                  current=uniform(4, 256), now=0)
    assert d.action == "wait" and "not measured" in d.reason
    d, _ = decide(SETTINGS, PolicyState(), COST, figures(HIGH, {}), current=uniform(4, 256),
                  now=0)
    assert d.action == "wait" and d.reason == "no load observed"


def test_the_lowest_range_keeps_probing():
    zero = extend_positions((0.0,), 8)
    settings = PolicySettings(max_k=8, max_batch=256, margin=0, confirmations=1,
                              min_interval_s=0)
    d, _ = decide(settings, PolicyState(), COST, figures(zero, {1: 1.0}), current=uniform(4, 256),
                  now=0)
    assert k_for_batch(d.proposed, 1, 8) == 1 and k_for_batch(d.proposed, 200, 8) == 0


def test_positions_are_estimated_against_the_drafts_that_reached_them():
    # Half the drafted request-steps ran K=1 (batch 2), half K=2 (batch 1, twice as many steps):
    schedule = validate([[1, 1, 2], [2, 2, 1]], max_k=2)
    p = estimate_positions((80.0, 32.0), drafts=100.0, batch_weights={1: 2.0, 2: 1.0},
                           current=schedule, max_k=2)
    assert p == pytest.approx((0.8, 0.64))


def test_calibration_corrects_one_kind_and_lends_it_to_the_other_until_measured():
    on = calibrate(COST, measured_itl_s=2 * COST.modelled(1, 4), batch_weights={1: 1.0},
                   k_of=lambda b: 4)
    assert on.factor_on == pytest.approx(2.0) and on.factor_off is None
    assert on.step_time(1, 0) == pytest.approx(2 * COST.modelled(1, 0))
    mixed = calibrate(on, measured_itl_s=1.0, batch_weights={1: 1.0, 64: 1.0},
                      k_of=lambda b: 4 if b == 1 else 0)
    assert mixed == on  # a window with both kinds says nothing about either
    assert mean_step_time({}, lambda b: 0, COST.modelled) is None


def test_window_figures_and_restart_detection():
    w = MetricsWindow(30.0)
    w.add(Snapshot(0, 1, 0, 0, (0.0, 0.0), 0, 0, 0))
    w.add(Snapshot(10, 1, 0, 100, (80.0, 40.0), 2.0, 100, 220))
    found = w.figures(uniform(2, 8), 2)
    assert found is not None
    assert found.figures.per_position == pytest.approx((0.8, 0.4))
    assert found.measured_itl_s == pytest.approx(0.02)
    assert found.tokens_per_busy_second == pytest.approx(22.0)
    w.add(Snapshot(20, 1, 0, 5, (1.0, 0.0), 0.1, 5, 10))  # counters went back: restarted
    assert w.figures(uniform(2, 8), 2) is None


def test_rollout_moves_only_along_its_table():
    r = Rollout()
    for state in (RolloutState.LEASED, RolloutState.DRAINING, RolloutState.RESTARTING,
                  RolloutState.ROLLING_BACK, RolloutState.IDLE):
        r.move(state)
    with pytest.raises(IllegalTransition):
        r.move(RolloutState.RESTARTING)


def test_gate_holds_while_the_pool_sheds_or_queues():
    assert may_start(shed_increase=None, pool_waiting=0, max_waiting=16) == (True, "ok")
    ok, why = may_start(shed_increase=3, pool_waiting=0, max_waiting=16)
    assert not ok and "shedding" in why
    ok, why = may_start(shed_increase=0, pool_waiting=20, max_waiting=16)
    assert not ok and "queues 20" in why
