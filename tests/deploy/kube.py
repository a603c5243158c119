"""Helpers for the Kubernetes manifests under ``deploy/kubernetes``: render a kustomization with
``kubectl kustomize`` and build the PrometheusRule from ``deploy/prometheus/alerts.yml``.

The PrometheusRule is a generated file: its ``spec.groups`` is ``alerts.yml``'s ``groups``, so the
operator's rules and compose's rules are the same rules. Regenerate it after changing the alerts:

    .venv/bin/python tests/deploy/kube.py --write-rules

``kubectl`` is the one named by ``$KVPROXY_KUBECTL``, else the one on ``PATH`` (Debian's
``kubernetes-client``, installed by ``scripts/setup.sh --kubectl``). The manifests stay within
what every kustomize from v2.0.3 (kubectl 1.20, Debian bookworm) to v5 renders the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_FILE = KUBE / "monitoring" / "prometheusrule.yaml"
KUSTOMIZATIONS = ("base", "monitoring", "overlays/gpu", "overlays/sim")

_HEADER = """\
# GENERATED from deploy/prometheus/alerts.yml by `tests/deploy/kube.py --write-rules`; do not edit.
# The Prometheus operator's copy of the alert rules compose's Prometheus loads: spec.groups is that
# file's groups, unchanged (tests/deploy/test_kubernetes.py fails when they differ).
"""


def find_kubectl() -> str | None:
    return os.environ.get("KVPROXY_KUBECTL") or shutil.which("kubectl")


def render(kubectl: str, kustomization: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize deploy/kubernetes/<kustomization>`` prints."""
    out = subprocess.run([kubectl, "kustomize", str(KUBE / kustomization)], capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {kustomization} failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def prometheus_rule() -> dict[str, Any]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvproxy-alerts", "labels": {"app.kubernetes.io/name": "kvproxy"}},
        "spec": {"groups": groups},
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (long PromQL) as literal blocks, as alerts.yml writes them."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def rule_file_text() -> str:
    body = yaml.dump(prometheus_rule(), Dumper=_Dumper, sort_keys=False, width=100,
                     allow_unicode=True)  # fmt: skip
    return _HEADER + body


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-rules"]:
        sys.exit("usage: tests/deploy/kube.py --write-rules")
    RULE_FILE.write_text(rule_file_text())
    print(f"wrote {RULE_FILE.relative_to(ROOT)}")
