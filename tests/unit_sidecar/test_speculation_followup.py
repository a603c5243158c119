"""The follow-up re-evaluation of a change made on thin evidence (pure policy)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sidecar.speculation.cost import StepCost
from engine_sidecar.speculation.policy import (
    Figures,
    PolicySettings,
    PolicyState,
    committed,
    decide,
    extend_positions,
    measured,
    position_reach,
)
from engine_sidecar.speculation.schedule import Schedule, k_for_batch, uniform, validate

COST = StepCost(fixed_s=0.004, weights_s=0.026, kv_per_seq_s=0.00006,
                compute_per_token_s=0.00013, draft_pass_s=0.002)
HIGH = extend_positions((0.8, 0.64), 8)
SETTINGS = PolicySettings(max_k=8, max_batch=256, min_interval_s=300, confirmations=2)
ONLY_FIRST = (1000.0,) + (0.0,) * 7  # what a window at K 1 measured: position 1 alone
ALL = (1000.0,) * 8


def test_reach_counts_the_drafts_that_proposed_each_position():
    mixed = validate([[1, 8, 4], [9, 256, 1]], max_k=8)
    # Equal time at batch 1 (K 4) and batch 9 (K 1): 1 of 10 drafts reached positions 2-4.
    reach = position_reach(1000.0, {1: 1.0, 9: 1.0}, mixed, 8)
    assert reach[0] == 1000.0 and reach[1] == reach[3] == 100.0 and reach[4] == 0.0
    assert measured(Figures(HIGH, {1: 1.0}, 1000.0, position_drafts=reach), 1, 400)
    assert not measured(Figures(HIGH, {1: 1.0}, 1000.0, position_drafts=reach), 2, 400)
    assert measured(Figures(HIGH, {1: 1.0}, 1000.0), 8, 400)  # not known: no follow-up


def _change_on_thin_evidence() -> tuple[PolicyState, Schedule]:
    seen = Figures(HIGH, {1: 1.0}, 1000.0, position_drafts=ONLY_FIRST)
    d, state = decide(SETTINGS, PolicyState(), COST, seen, current=uniform(1, 256), now=0,
                      shifted=True)
    assert d.action == "change" and d.provisional and not d.followup
    assert k_for_batch(d.proposed, 1, 8) >= 5
    return committed(state, 0, d), d.proposed


def test_a_change_on_measured_positions_is_not_provisional():
    seen = Figures(HIGH, {1: 1.0}, 1000.0, position_drafts=ALL)
    d, state = decide(SETTINGS, PolicyState(), COST, seen, current=uniform(1, 256), now=0,
                      shifted=True)
    assert d.action == "change" and not d.provisional
    assert not committed(state, 0, d).followup


def test_the_follow_up_waits_for_every_drafted_position_then_goes_once_with_a_small_margin():
    state, landed = _change_on_thin_evidence()
    assert state.followup
    # Measured at the landing, acceptance is a little better than the shift's first estimate:
    # a gain under the ordinary margin, above the follow-up's.
    better = extend_positions((0.85, 0.73), 8)
    thin = Figures(better, {1: 1.0}, 1000.0, position_drafts=(1000.0,) * 5 + (100.0, 0, 0))
    d, state = decide(SETTINGS, state, COST, thin, current=landed, now=10)
    assert not d.followup and d.action != "change" and state.followup
    full = Figures(better, {1: 1.0}, 1000.0, position_drafts=ALL)
    d, state = decide(SETTINGS, state, COST, full, current=landed, now=20)
    assert d.followup and d.action == "change", d.reason
    assert SETTINGS.followup_margin < d.predicted_gain <= SETTINGS.margin
    assert not d.provisional  # a follow-up never earns another one
    corrected = d.proposed
    state = committed(state, 20, d)
    assert not state.followup
    # The same evidence again, against the landing: the ordinary margin and interval hold.
    d, _ = decide(SETTINGS, state, COST, full, current=landed, now=30)
    assert d.action == "keep" and not d.followup
    assert k_for_batch(corrected, 1, 8) > k_for_batch(landed, 1, 8)


def test_a_follow_up_within_its_margin_keeps_and_is_spent():
    state, landed = _change_on_thin_evidence()
    full = Figures(HIGH, {1: 1.0}, 1000.0, position_drafts=ALL)
    d, state = decide(SETTINGS, state, COST, full, current=landed, now=10)
    assert d.followup and d.action == "keep"
    assert not state.followup


@settings(max_examples=60, deadline=None)
@given(p1=st.floats(0.05, 0.95), p2=st.floats(0.0, 1.0), batch=st.integers(1, 64),
       k=st.integers(1, 8), margin=st.floats(0.0, 0.2), followup=st.floats(0.0, 0.3))
def test_a_follow_up_never_needs_more_than_the_ordinary_margin(p1, p2, batch, k, margin,
                                                               followup):
    s = PolicySettings(max_k=8, max_batch=256, margin=margin, followup_margin=followup,
                       min_interval_s=0, confirmations=1)
    p = extend_positions((p1, p1 * p2), 8)
    fig = Figures(p, {batch: 1.0}, 1000.0, position_drafts=ALL)
    plain, _ = decide(s, PolicyState(), COST, fig, current=uniform(k, 256), now=0)
    after, _ = decide(s, PolicyState(followup=True), COST, fig, current=uniform(k, 256), now=0)
    assert after.followup and after.required_gain <= plain.required_gain + 1e-12
    if plain.action == "change":
        assert after.action == "change"
