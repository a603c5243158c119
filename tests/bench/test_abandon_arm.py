"""The routing suite's ``+abandon`` arm: kvproxy started with ``routing.charge_abandoned`` on,
everything else as the default arm beside it (same policy, no precise mode)."""

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
    # The rule is the default now: the plain arm runs it too, from the default config.
    assert off.charge_abandoned == RoutingConfig().charge_abandoned


def test_the_arm_exists_for_the_cost_model_only() -> None:
    every = parse_router_list("kvproxy/*")
    assert "kvproxy/expected_ttft+abandon" in {r.name for r in every}
    with pytest.raises(ValueError, match="unknown router"):
        parse_router_list("kvproxy/round_robin+abandon")
