"""The offline decision replay drives kvproxy's policies through the proxy's own engine state on
the simulator's scheduler (catches API drift in either), and its audit sees what engines hold."""

import pytest

from bench.replay import (
    CacheAware,
    KvproxyRouter,
    UnboundedHoldings,
    calibration,
    replay,
    summarise,
)
from bench.traces import TraceRequest
from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT

pytest.importorskip("engine_sidecar.sim.scheduler")

# Three "conversations" in turn: each request repeats its conversation's blocks and adds one.
REQS = [TraceRequest(i, i * 0.4, 512 * (1 + i // 3) + 40, 8,
                     tuple(range(100 * (i % 3), 100 * (i % 3) + 1 + i // 3)))
        for i in range(12)]


def _run(router: object) -> dict[str, object]:
    out = replay(REQS, router, engines=2, profile="llama70b-h100x4", rate_scale=1.0,
                 scrape_s=0.6)  # type: ignore[arg-type]
    assert len(out.ttft) == len(REQS) and all(t > 0 for t in out.ttft.values())
    assert sum(out.per_engine) == len(REQS)
    return summarise("x", out, REQS)


@pytest.mark.parametrize("policy", ["expected_ttft", "prefix_affinity", "round_robin",
                                    "expected_ttft+abandon", "expected_ttft+drain",
                                    "expected_ttft+nodecode"])
def test_kvproxy_policies_serve_every_request(policy: str) -> None:
    _run(KvproxyRouter(policy, 2, RoutingConfig()))


def test_affinity_keeps_conversations_home_and_round_robin_does_not() -> None:
    ttft = _run(KvproxyRouter("expected_ttft", 2, RoutingConfig()))
    rr = _run(KvproxyRouter("round_robin", 2, RoutingConfig()))
    # Round robin over two engines moves each conversation of three at every turn, away from
    # its history; the cost model follows the history.
    assert ttft["hit"] > rr["hit"]
    assert ttft["moved_off_history"] == 0.0 < rr["moved_off_history"]  # type: ignore[operator]


def test_cache_aware_model_is_deterministic() -> None:
    assert _run(CacheAware(2)) == _run(CacheAware(2))


def test_variants_set_their_rule_and_unknown_ones_are_refused() -> None:
    # From a configuration with the rule off, so that only the variant can turn it on.
    off = RoutingConfig(charge_abandoned=False)
    router = KvproxyRouter("expected_ttft+abandon", 2, off)
    assert router.cfg.charge_abandoned and not router.drain
    assert not KvproxyRouter("expected_ttft", 2, off).cfg.charge_abandoned
    assert KvproxyRouter("expected_ttft+unbounded", 2, off).cfg.charge_abandoned
    assert KvproxyRouter("expected_ttft+drain", 2, RoutingConfig()).drain
    assert not KvproxyRouter("expected_ttft+plain", 2, RoutingConfig()).cfg.charge_abandoned
    unbounded = KvproxyRouter("expected_ttft+unbounded", 2, RoutingConfig())
    assert unbounded.cfg.charge_abandoned
    assert isinstance(unbounded.policy, ExpectedTTFT)
    assert isinstance(unbounded.policy.holdings, UnboundedHoldings)
    with pytest.raises(ValueError, match="unknown variants"):
        KvproxyRouter("expected_ttft+faster", 2, RoutingConfig())
    assert KvproxyRouter("expected_ttft", 2, RoutingConfig()).cfg.decode_charge > 0.0
    assert KvproxyRouter("expected_ttft+nodecode", 2, RoutingConfig()).cfg.decode_charge == 0.0
    shared = KvproxyRouter("expected_ttft", 2, RoutingConfig(decode_charge=0.5))
    assert shared.cfg.decode_charge == 0.5


def test_inter_token_gaps_are_the_steps_after_the_first_token() -> None:
    out = replay(REQS, KvproxyRouter("expected_ttft", 2, RoutingConfig()), engines=2,
                 profile="llama70b-h100x4", rate_scale=1.0, scrape_s=0.6)
    # No speculation: one token a step, so every output token after a request's first has one
    # gap, each at least a decode step long.
    assert len(out.itl) == sum(r.output_tokens - 1 for r in REQS)
    assert min(out.itl) > 0.005
    assert min(out.itl) <= summarise("x", out, REQS)["itl_p99"] <= max(out.itl)  # type: ignore[operator]


def test_calibration_pairs_each_pick_with_its_prediction() -> None:
    out = replay(REQS, KvproxyRouter("expected_ttft", 2, RoutingConfig()), engines=2,
                 profile="llama70b-h100x4", rate_scale=1.0, scrape_s=0.6)
    rows = calibration(out)
    assert sum(r["n"] for r in rows) == len(REQS)
    for r in rows:
        assert r["from_s"] <= r["predicted_p50"] < r["to_s"]
        assert 0.0 < r["ratio_p10"] <= r["ratio_p50"] <= r["ratio_p90"]
    # Every prediction is the picked engine's own estimate, and the summary's ratio is the real
    # TTFT over it, request by request.
    ratios = sorted(out.ttft[x["rid"]] / x["predicted"] for x in out.decisions)
    assert all(x["predicted"] == x["est"][f"e{x['pick']}"][3] for x in out.decisions)
    s = summarise("x", out, REQS)
    assert ratios[0] <= s["real/predicted"] <= ratios[-1]  # type: ignore[operator]
    # A policy without a model predicts nothing.
    assert calibration(replay(REQS, CacheAware(2), engines=2, profile="llama70b-h100x4",
                              rate_scale=1.0, scrape_s=0.6)) == []
