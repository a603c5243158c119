"""The alert rules and the dashboard's queries, checked by Prometheus' own ``promtool``: every rule
parses (``check rules``), every alert fires on synthetic series where it should and stays quiet
where it should not (``test rules`` on ``deploy/prometheus/alerts.test.yml``), and every dashboard
query parses as PromQL. ``promtool`` comes from Debian's ``prometheus`` package
(``scripts/setup.sh --prometheus``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tiers import missing

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvproxy.json"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        missing("promtool is not installed (scripts/setup.sh --prometheus installs it)")
    return found


def run(promtool: str, *args: str) -> str:
    out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120,
                         check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_every_rule_parses(promtool: str) -> None:
    out = run(promtool, "check", "rules", str(RULES))
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert f"{len(rules)} rules found" in out


def test_alerts_fire_where_they_should_and_only_there(promtool: str) -> None:
    run(promtool, "test", "rules", str(RULE_TESTS))


def test_every_alert_has_a_unit_test() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
              if "alert" in r}  # fmt: skip
    tested = {case["alertname"] for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in t.get("alert_rule_test", [])}  # fmt: skip
    assert alerts - tested == set()


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if t.get("expr")]


def test_every_dashboard_query_parses(promtool: str, tmp_path: Path) -> None:
    # promtool checks PromQL inside rule files: each query becomes a recording rule.
    queries = dashboard_queries()
    rules = [{"record": f"dashboard:query{i}", "expr": q} for i, q in enumerate(queries)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"{len(rules)} rules found" in run(promtool, "check", "rules", str(path))


def test_no_shed_share_counts_sheds_twice() -> None:
    # kvproxy_requests_total already counts shed requests: adding kvproxy_shed_total to it in a
    # denominator understates the share.
    twice = re.compile(r"kvproxy_requests_total[^/]*\+[^/]*kvproxy_shed_total"
                       r"|kvproxy_shed_total[^/]*\+[^/]*kvproxy_requests_total")
    exprs = dashboard_queries()
    exprs += [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert [e for e in exprs if twice.search(e)] == []
    assert any("kvproxy_shed_total" in e for e in exprs)
