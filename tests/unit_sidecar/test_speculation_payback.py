"""When a restart pays, how a shift is detected, and the step cost of prefill sharing steps."""

import random
from dataclasses import replace

import pytest

from engine_sidecar.speculation.cost import StepCost, tokens_per_step
from engine_sidecar.speculation.policy import (
    Figures,
    PolicySettings,
    PolicyState,
    committed,
    decide,
    extend_positions,
    required_gain,
)
from engine_sidecar.speculation.schedule import k_for_batch, uniform
from engine_sidecar.speculation.shift import ShiftSettings, change_point
from engine_sidecar.speculation.window import MetricsWindow, Snapshot
from engine_sidecar.vllm.adaptive import _controller_settings, settings_from
from engine_sidecar.vllm.profile import ProfileError, parse_profile

COST = StepCost(fixed_s=0.004, weights_s=0.026, kv_per_seq_s=0.00002,
                compute_per_token_s=0.00013, draft_pass_s=0.002)
HIGH = extend_positions((0.8, 0.64), 8)
LOW = extend_positions((0.3, 0.09), 8)
SETTINGS = PolicySettings(max_k=8, max_batch=256, min_interval_s=0, confirmations=2,
                          horizon_s=600, restart_cost_s=60)


def test_a_restart_costs_nothing_while_the_pool_has_room_and_its_time_out_once_full():
    assert required_gain(SETTINGS, 0.2, None) == pytest.approx(0.05)
    assert required_gain(SETTINGS, 0.5, 30.0) == pytest.approx(0.05)
    assert required_gain(SETTINGS, 0.75, 30.0) == pytest.approx(0.05 + 0.5 * 30 / 600)
    assert required_gain(SETTINGS, 1.0, None) == pytest.approx(0.05 + 60 / 600)


def test_a_change_worth_it_when_idle_waits_while_the_pool_is_full_and_goes_when_it_empties():
    current = uniform(6, 256)
    # Acceptance fell; batch 16 still bandwidth-bound, so the gain is real but modest.
    busy = Figures(LOW, {16: 1.0}, 1000.0, load=1.0)
    state = PolicyState()
    for now in (0, 10, 20):
        d, state = decide(SETTINGS, state, COST, busy, current=current, now=now, out_s=200.0)
        assert d.action == "wait", d.reason
    assert "not worth a restart at load 100%" in d.reason
    assert 0.05 < d.predicted_gain <= d.required_gain
    quiet = Figures(LOW, {16: 1.0}, 1000.0, load=0.3)
    d, state = decide(SETTINGS, state, COST, quiet, current=current, now=30, out_s=200.0)
    assert d.action == "change" and d.required_gain == pytest.approx(0.05)


def test_a_detected_shift_stands_in_for_the_confirmations():
    d, _ = decide(SETTINGS, PolicyState(), COST, Figures(LOW, {1: 1.0}, 500.0),
                  current=uniform(6, 256), now=0, shifted=True)
    assert d.action == "change"
    d, _ = decide(SETTINGS, PolicyState(), COST, Figures(LOW, {1: 1.0}, 500.0),
                  current=uniform(6, 256), now=0)
    assert d.action == "wait" and "confirmation 1/2" in d.reason


def test_a_restart_sets_every_range_to_its_best_k_not_only_those_that_beat_the_margin():
    settings = PolicySettings(max_k=8, max_batch=256, margin=0.05, confirmations=1,
                              min_interval_s=0, tie=0.0)
    current = uniform(4, 256)
    d, _ = decide(settings, PolicyState(), COST, Figures(HIGH, {1: 1.0}, 1000.0),
                  current=current, now=0)
    assert d.action == "change"
    assert all(c.chosen_k == c.best_k for c in d.ranges[1:])


def test_near_ties_go_to_the_shorter_draft():
    wide = PolicySettings(max_k=8, max_batch=256, confirmations=1, min_interval_s=0, tie=0.2)
    exact = PolicySettings(max_k=8, max_batch=256, confirmations=1, min_interval_s=0, tie=0.0)
    f = Figures(HIGH, {1: 1.0}, 1000.0)
    d_wide, _ = decide(wide, PolicyState(), COST, f, current=uniform(1, 256), now=0)
    d_exact, _ = decide(exact, PolicyState(), COST, f, current=uniform(1, 256), now=0)
    assert k_for_batch(d_wide.proposed, 1, 8) < k_for_batch(d_exact.proposed, 1, 8)


def test_prefill_sharing_the_steps_makes_long_drafts_dearer_at_large_batches_only():
    with_prefill = StepCost(**{**COST.__dict__, "prefill_per_token": 1.6,
                               "prefill_chunk": 256.0})

    def best_k(cost: StepCost, batch: int) -> int:
        rates = [batch * tokens_per_step(HIGH, k) / cost.step_time(batch, k,
                                                                   tokens_per_step(HIGH, k))
                 for k in range(9)]
        return max(range(9), key=lambda k: rates[k])

    assert best_k(with_prefill, 1) == best_k(COST, 1)
    assert best_k(with_prefill, 48) < best_k(COST, 48)
    # The mixture of steps with and without a chunk, not the step of the mean load:
    mean_load = COST.compute_per_token_s * (48 * 3 + 1.6 * 48 * tokens_per_step(HIGH, 2))
    assert with_prefill.modelled(48, 2, tokens_per_step(HIGH, 2)) > COST.fixed_s + max(
        COST.weights_s + COST.kv_per_seq_s * 48, mean_load) + 2 * COST.draft_pass_s


def _polls(rates: list[float], drafts: int, seed: int = 7) -> list[tuple[float, float]]:
    rng = random.Random(seed)
    return [(float(drafts), float(sum(rng.random() < p for _ in range(drafts))))
            for p in rates]


def test_a_shift_in_first_position_acceptance_is_found_where_it_happened():
    polls = _polls([0.8] * 10 + [0.3] * 3, drafts=60)
    shift = change_point(polls, ShiftSettings())
    assert shift is not None and shift.index == 10
    assert shift.before == pytest.approx(0.8, abs=0.07) and shift.after < 0.45


def test_noise_small_shifts_and_load_ramps_are_not_shifts():
    settings = ShiftSettings()
    for seed in range(20):
        assert change_point(_polls([0.8] * 20, drafts=60, seed=seed), settings) is None
    # Statistically certain, but a few percent: no reason to restart anything.
    assert change_point(_polls([0.80] * 10 + [0.76] * 10, drafts=20000), settings) is None
    # A ramp multiplies the drafts per poll, not the rate.
    ramp = [(float(d), 0.8 * d) for d in (30, 60, 200, 800, 2000, 4000)]
    assert change_point(ramp, settings) is None
    with pytest.raises(ValueError):
        ShiftSettings(min_shift=0)


def test_window_polls_cut_load_and_prefill_share():
    w = MetricsWindow(100.0)
    w.add(Snapshot(0, 10, 0, 0, (0.0,), 0, 0, 0, kv_usage=0.6))
    w.add(Snapshot(5, 10, 0, 100, (80.0,), 1, 50, 500, kv_usage=0.8, prefill_tokens=800,
                   requests=5))
    w.add(Snapshot(10, 10, 0, 200, (110.0,), 2, 100, 1000, kv_usage=1.0, prefill_tokens=1600,
                   requests=10))
    assert w.polls() == [(100.0, 80.0), (100.0, 30.0)]
    found = w.figures(uniform(1, 64), 1, max_batch=64)
    assert found is not None
    assert found.load == pytest.approx(0.8) and found.figures.load == pytest.approx(0.8)
    assert found.prefill_per_token == pytest.approx(1.6)
    assert found.prefill_chunk == pytest.approx(160.0)
    w.cut(1)
    assert w.polls() == [(100.0, 30.0)]


def test_the_profile_sets_the_new_settings_and_refuses_bad_ones_naming_them():
    base = ('[engine]\nmodel = "/m/target"\nserved_model_name = "t"\n'
            'speculative = { method = "ngram", num_speculative_tokens = 4 }\n'
            '[speculation]\nadaptive = true\ncoordination = "local"\n')
    profile = parse_profile(base + 'horizon_s = 1200\nspare_load = 0.25\nshift_min = 0.2\n',
                            name="p", env={})
    settings = _controller_settings(profile, settings_from(profile))
    assert settings.policy.horizon_s == 1200 and settings.policy.spare_load == 0.25
    assert settings.shift.min_shift == 0.2 and settings.policy.tie == 0.01
    for bad in ('spare_load = 1.0\n', 'horizon_s = 0\n', 'shift_min = 0\n', 'tie = -1.0\n'):
        with pytest.raises(ProfileError) as exc:
            settings_from(parse_profile(base + bad, name="p", env={}))
        assert exc.value.field == "speculation"
    # A number that is not finite passes every "> 0" check after it: refused where it is read.
    for bad, field in (('poll_s = nan\n', "speculation.poll_s"),
                       ('eval_s = inf\n', "speculation.eval_s"),
                       ('margin = nan\n', "speculation.margin"),
                       ('proxy_metrics_urls = [1]\n', "speculation.proxy_metrics_urls")):
        with pytest.raises(ProfileError) as exc:
            settings_from(parse_profile(base + bad, name="p", env={}))
        assert exc.value.field == field



def test_a_shift_stands_in_for_the_confirmations_until_a_change_is_made():
    # After a shift the change is held (the pool's lease); the next decision proposes a schedule
    # that differs in a range never seen (its prefill share moved). It still goes at once.
    a = replace(COST, prefill_per_token=0.0, prefill_chunk=256.0)
    b = replace(COST, prefill_per_token=2.0, prefill_chunk=256.0)
    seen = Figures(HIGH, {1: 1.0}, 1000.0)
    d, state = decide(SETTINGS, PolicyState(), a, seen, current=uniform(1, 256), now=0,
                      shifted=True)
    assert d.action == "change"
    first = d.proposed
    d, held = decide(SETTINGS, state, b, seen, current=uniform(1, 256), now=2)
    assert k_for_batch(d.proposed, 64, 8) != k_for_batch(first, 64, 8)
    assert d.action == "change", d.reason
    # Without a shift the same two proposals are two different proposals: count again.
    d, state = decide(SETTINGS, PolicyState(), a, seen, current=uniform(1, 256), now=0)
    d, state = decide(SETTINGS, state, b, seen, current=uniform(1, 256), now=2)
    assert d.action == "wait" and "confirmation 1/2" in d.reason
    # A keep ends the shift's confirmation; so does a change made (``committed``).
    _, after_keep = decide(SETTINGS, held, a, seen, current=first, now=4)
    assert not after_keep.confirmed and not committed(held, 6).confirmed
