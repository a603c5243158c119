"""The routing suite's ``+abandon`` and ``+plain`` arms: kvproxy started with
``routing.charge_abandoned`` on or off, everything else as the default arm beside them (same
policy, no precise mode)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.peers import Router, _kvproxy, parse_router_list
from proxy.core.config import RoutingConfig
from proxy.core.configload import load_config

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _routing(router: Router, work: Path) -> RoutingConfig:
    work.mkdir()
    argv, _env, _ready, _headers = _kvproxy(router, URLS, "m", 9100, work)
    return load_config(argv[argv.index("--config") + 1], {}, []).routing


def test_the_abandon_arm_turns_the_rule_on_and_nothing_else(tmp_path: Path) -> None:
    [arm] = parse_router_list("kvproxy/expected_ttft+abandon")
    assert arm.name == "kvproxy/expected_ttft+abandon"
    assert arm.abandon and not arm.precise
    on = _routing(arm, tmp_path / "on")
    off = _routing(Router("kvproxy", "expected_ttft"), tmp_path / "off")
    assert on.policy == off.policy == "expected_ttft"
    assert on.charge_abandoned
    # Written out, not left to the default: the arm keeps its meaning if the default changes.
    assert "charge_abandoned = true" in (tmp_path / "on" / "kvproxy.toml").read_text()
    # The rule is the default now: the plain arm runs it too, from the default config.
    assert off.charge_abandoned == RoutingConfig().charge_abandoned


def test_the_plain_arm_turns_the_rule_off_and_nothing_else(tmp_path: Path) -> None:
    [arm] = parse_router_list("kvproxy/expected_ttft+plain")
    assert arm.plain and not arm.abandon and not arm.precise
    plain = _routing(arm, tmp_path / "plain")
    assert plain.policy == "expected_ttft"
    assert not plain.charge_abandoned
    assert RoutingConfig().charge_abandoned  # so the plain arm differs from the default


def test_the_arms_exist_for_the_cost_model_only() -> None:
    every = {r.name for r in parse_router_list("kvproxy/*")}
    assert {"kvproxy/expected_ttft+abandon", "kvproxy/expected_ttft+plain"} <= every
    for name in ("kvproxy/round_robin+abandon", "kvproxy/round_robin+plain"):
        with pytest.raises(ValueError, match="unknown router"):
            parse_router_list(name)
