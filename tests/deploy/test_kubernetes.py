"""The Kubernetes manifests (``deploy/kubernetes``), rendered and checked offline; no cluster.

- Every kustomization renders with ``kubectl kustomize`` (``tests/deploy/kube.py``).
- Core objects validate against the Kubernetes JSON schemas (``kubernetes-validate``, strict: an
  unknown field fails) for the oldest and the newest Kubernetes it ships.
- The CRDs validate against models generated from their published schemas (``cloudcoil-models-*``
  from PyPI, KEDA 2.16 and prometheus-operator 0.80) with unknown fields forbidden.
- The PrometheusRule is ``alerts.yml``; its rules and the KEDA queries pass ``promtool``.
- The manifests agree with what the containers run: the drain fits in the grace period, the TOMLs
  load with the proxy's own config loader and match ``deploy/kvproxy``, engine commands match
  ``compose.yaml``, and a registered engine has the name of the configured one.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject
from pydantic import ValidationError
from tiers import missing

from deploy.kube import (
    ALERTS,
    KUBE,
    KUSTOMIZATIONS,
    ROOT,
    RULE_FILE,
    find_kubectl,
    render,
    rule_file_text,
)
from engine_sidecar.vllm.profile import describe, load_profile, with_overrides
from proxy.core.config import Config
from proxy.core.configload import load_config
from proxy.tenancy.shared_state import EngineRecord

Obj = dict[str, Any]
K8S_VERSIONS = ("1.25", "1.37")  # the oldest and newest schemas kubernetes-validate ships
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    kubectl = find_kubectl()
    if kubectl is None:
        missing("kubectl is not installed (scripts/setup.sh --kubectl installs it)")
    return {name: render(kubectl, name) for name in KUSTOMIZATIONS}


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_templates(objs: list[Obj]) -> Iterator[Obj]:
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o


def config_toml(objs: list[Obj]) -> str:
    (cm,) = [o for o in find(objs, "ConfigMap") if o["metadata"]["name"].startswith("kvproxy-")]
    text: str = cm["data"]["kvproxy.toml"]
    return text


def load_toml_config(text: str, tmp_path: Path) -> Config:
    path = tmp_path / "kvproxy.toml"
    path.write_text(text)
    return load_config(str(path), {}, [])


# ---- rendering and schemas --------------------------------------------------------------------


def test_every_kustomization_renders(rendered: dict[str, list[Obj]]) -> None:
    kinds = {name: {o["kind"] for o in objs} for name, objs in rendered.items()}
    core = {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    assert core <= kinds["base"]
    assert kinds["monitoring"] == {"ServiceMonitor", "PrometheusRule"}
    assert core | {"ConfigMap", "StatefulSet", "ScaledObject", "ServiceMonitor",
                   "PrometheusRule"} <= kinds["overlays/gpu"]  # fmt: skip
    assert core | {"ConfigMap"} <= kinds["overlays/sim"]
    for name in ("overlays/gpu", "overlays/sim"):
        assert {o["metadata"].get("namespace") for o in rendered[name]} == {"kvproxy"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_objects_validate_against_the_kubernetes_schemas(
    rendered: dict[str, list[Obj]], version: str
) -> None:
    secret = yaml.safe_load((KUBE / "base" / "secret.example.yaml").read_text())
    checked = 0
    for objs in [*rendered.values(), [secret]]:
        for obj in objs:
            if "." in obj["apiVersion"].split("/")[0] and "k8s.io" not in obj["apiVersion"]:
                continue  # a CRD: next test
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
    assert checked > 20


CRD_MODELS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "cloudcoil.models.keda.v1alpha1",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "cloudcoil.models.prometheus_operator.v1",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "cloudcoil.models.prometheus_operator.v1",
}


def test_custom_resources_validate_against_their_published_schemas(
    rendered: dict[str, list[Obj]],
) -> None:
    checked = set()
    for obj in rendered["overlays/gpu"]:
        key = (obj["apiVersion"], obj["kind"])
        if key[0].split("/")[0] in ("v1", "apps", "policy", "autoscaling"):
            continue
        assert key in CRD_MODELS, f"no schema for {key}"
        model = getattr(importlib.import_module(CRD_MODELS[key]), obj["kind"])
        # Unknown fields (a typo, a field of another version) fail, as in the CRD's schema.
        model.model_validate(obj, extra="forbid", by_alias=True, by_name=False)
        checked.add(key)
    assert checked == set(CRD_MODELS)


def test_a_misspelt_custom_resource_field_is_refused() -> None:
    bad = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"},
           "spec": {"scaleTargetRef": {"name": "t"}, "minReplicas": 1, "triggers": []}}  # fmt: skip
    with pytest.raises(ValidationError, match="minReplicas"):
        ScaledObject.model_validate(bad, extra="forbid", by_alias=True, by_name=False)


# ---- alert rules and autoscaling queries ------------------------------------------------------


def test_prometheus_rule_is_alerts_yml(rendered: dict[str, list[Obj]]) -> None:
    rule = one(rendered["monitoring"], "PrometheusRule", "kvproxy-alerts")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    assert RULE_FILE.read_text() == rule_file_text(), (
        "regenerate with: .venv/bin/python tests/deploy/kube.py --write-rules"
    )


def promtool_check(queries: dict[str, str], tmp_path: Path, rules: list[Obj] | None = None) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("promtool is not installed (scripts/setup.sh --prometheus installs it)")
    groups = [{"name": "queries", "rules": [{"record": k, "expr": q} for k, q in queries.items()]}]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rules if rules is not None else groups}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_rule_passes_promtool(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    rule = one(rendered["overlays/gpu"], "PrometheusRule", "kvproxy-alerts")
    promtool_check({}, tmp_path, rules=rule["spec"]["groups"])


def test_engines_scale_per_pool_on_queue_length_shed_rate_and_expected_wait(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    objs = rendered["overlays/gpu"]
    queries = {}
    for pool in ("draft", "target"):
        scaled = one(objs, "ScaledObject", pool)
        ref = scaled["spec"]["scaleTargetRef"]
        assert one(objs, ref["kind"], ref["name"])["metadata"]["labels"]["pool"] == pool
        # The configured engine is pod ordinal 0: scaling to zero would remove it.
        assert scaled["spec"]["minReplicaCount"] >= 1
        by_metric = {}
        for trig in scaled["spec"]["triggers"]:
            assert trig["type"] == "prometheus"
            query = trig["metadata"]["query"]
            assert f'pool="{pool}"' in query and 'namespace="kvproxy"' in query
            found = re.findall(r"(vllm:num_requests_waiting|kvproxy_shed_total|"
                               r"kvproxy_pool_expected_wait_seconds)", query)
            by_metric[found[0]] = 1
            queries[f"keda:{trig['name']}".replace("-", "_")] = query
        assert set(by_metric) == {"vllm:num_requests_waiting", "kvproxy_shed_total",
                                  "kvproxy_pool_expected_wait_seconds"}
    promtool_check(queries, tmp_path)


def test_scraped_jobs_are_the_ones_the_alerts_name(rendered: dict[str, list[Obj]]) -> None:
    jobs = set(re.findall(r'job="([^"]+)"', ALERTS.read_text()))
    for overlay in ("overlays/gpu", "overlays/sim"):
        services = find(rendered[overlay], "Service")
        for monitor in find(rendered["monitoring"], "ServiceMonitor"):
            spec = monitor["spec"]
            picked = [s for s in services
                      if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
            assert picked, f"{monitor['metadata']['name']} selects no Service in {overlay}"
            assert {s["metadata"]["labels"][spec["jobLabel"]] for s in picked} <= jobs
            for s in picked:  # every Service offers a port the monitor scrapes
                ports = {p["name"] for p in s["spec"]["ports"]}
                assert ports & {e["port"] for e in spec["endpoints"]}
                assert set(spec.get("targetLabels", [])) <= s["metadata"]["labels"].keys()


# ---- the proxy --------------------------------------------------------------------------------


def prestop_sleep_s(container: Obj) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return float(command[1])


@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/sim"])
def test_proxy_drains_within_its_grace_period(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    objs = rendered[overlay]
    cfg = load_toml_config(config_toml(objs), tmp_path)
    pod = one(objs, "Deployment", "kvproxy")["spec"]["template"]["spec"]
    (proxy,) = pod["containers"]
    # SIGTERM comes after preStop; then the drain, the final 0.5 s grace and cleanup.
    needed = prestop_sleep_s(proxy) + cfg.server.drain_timeout_s + 2
    assert pod["terminationGracePeriodSeconds"] >= needed
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/health"
    assert proxy["resources"]["requests"]["cpu"]  # the HPA's utilisation is relative to it
    port = proxy["ports"][0]
    assert port["containerPort"] == cfg.server.port
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    assert proxy["command"][proxy["command"].index("--config") + 1].startswith(mounts["config"])


def test_proxy_replicas_belong_to_the_autoscaler_and_the_disruption_budget(
    rendered: dict[str, list[Obj]],
) -> None:
    objs = rendered["base"]
    deployment = one(objs, "Deployment", "kvproxy")
    assert "replicas" not in deployment["spec"]  # kubectl apply would undo the HPA
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    hpa = one(objs, "HorizontalPodAutoscaler", "kvproxy")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "kvproxy"
    assert hpa["spec"]["minReplicas"] >= 2
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = one(objs, "PodDisruptionBudget", "kvproxy")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/sim"])
def test_every_reference_resolves(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    configmaps = {o["metadata"]["name"] for o in find(objs, "ConfigMap")}
    templates = [w["spec"]["template"] for w in pod_templates(objs)]
    for svc in find(objs, "Service"):
        sel = svc["spec"]["selector"].items()
        assert any(sel <= t["metadata"]["labels"].items() for t in templates), svc
    secret = yaml.safe_load((KUBE / "base" / "secret.example.yaml").read_text())
    for t in templates:
        for vol in t["spec"].get("volumes", []):
            if "configMap" in vol:
                assert vol["configMap"]["name"] in configmaps
        for c in t["spec"]["containers"]:
            refs = [e["secretRef"] for e in c.get("envFrom", []) if "secretRef" in e]
            refs += [e["valueFrom"]["secretKeyRef"] for e in c.get("env", [])
                     if "secretKeyRef" in e.get("valueFrom", {})]  # fmt: skip
            for ref in refs:
                assert ref["name"] == secret["metadata"]["name"]
                assert ref.get("key", "KVPROXY_CACHE_SECRET") in secret["stringData"]


def test_images_are_named_as_compose_names_them(rendered: dict[str, list[Obj]]) -> None:
    compose_images = {s["image"] for s in [COMPOSE["x-kvproxy-image"], COMPOSE["x-vllm-sidecar"]]}
    used = {c["image"] for objs in rendered.values() for w in pod_templates(objs)
            for c in w["spec"]["template"]["spec"]["containers"]}  # fmt: skip
    assert used - {COMPOSE["services"]["redis"]["image"]} == compose_images


# ---- sim overlay ------------------------------------------------------------------------------


def test_sim_config_is_deploy_kvproxy_sim_toml(rendered: dict[str, list[Obj]]) -> None:
    compose = (ROOT / "deploy/kvproxy/sim.toml").read_text()
    assert config_toml(rendered["overlays/sim"]) == compose, (
        "copy deploy/kvproxy/sim.toml to deploy/kubernetes/overlays/sim/kvproxy.toml"
    )


def test_sim_engines_run_compose_commands_behind_the_configured_urls(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    objs = rendered["overlays/sim"]
    cfg = load_toml_config(config_toml(objs), tmp_path)
    for pool in cfg.pools:
        workload = one(objs, "Deployment", f"sim-{pool.name}")
        (c,) = workload["spec"]["template"]["spec"]["containers"]
        expected = [a.replace("${SIM_TIME_SCALE:-1}", "$(SIM_TIME_SCALE)")
                    for a in COMPOSE["services"][f"sim-{pool.name}"]["command"]]  # fmt: skip
        assert c["command"] == expected
        assert workload["spec"]["replicas"] == 1  # not in the registry: one pod per Service
        svc_ports = {}
        for svc in find(objs, "Service", pool.name):
            svc_ports |= {p["port"]: p["targetPort"] for p in svc["spec"]["ports"]}
        for engine in pool.engines:
            host, port = engine.url.removeprefix("http://").split(":")
            assert host == pool.name and svc_ports[int(port)] in {
                p["containerPort"] for p in c["ports"]}


# ---- gpu overlay ------------------------------------------------------------------------------


def without_engines(cfg: Config) -> Any:
    pools = [(p.name, p.served, p.priority_scheduling, p.isolation) for p in cfg.pools]
    return (cfg.server, cfg.routing, cfg.aliases, cfg.redis.url, pools)


def test_gpu_config_is_deploy_kvproxy_gpu_toml_with_the_registry(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    k8s = load_toml_config(config_toml(rendered["overlays/gpu"]), tmp_path)
    compose = load_config(str(ROOT / "deploy/kvproxy/gpu.toml"), {}, [])
    assert without_engines(k8s) == without_engines(compose)
    assert k8s.redis.discover_engines


def engine_container(objs: list[Obj], pool: str) -> tuple[Obj, Obj]:
    pod = one(objs, "StatefulSet", pool)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return pod, c


def advertised(c: Obj, pod_name: str) -> tuple[str, str]:
    """The profile file and the host the sidecar advertises, as the kubelet expands them."""
    args = c["command"]
    host = args[args.index("--advertise-host") + 1].replace("$(POD_NAME)", pod_name)
    return args[args.index("--profile") + 1], host


def test_a_registered_engine_is_the_configured_engine(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    objs = rendered["overlays/gpu"]
    cfg = load_toml_config(config_toml(objs), tmp_path)
    for pool in cfg.pools:
        _, c = engine_container(objs, pool.name)
        profile_path, host = advertised(c, f"{pool.name}-0")
        profile = load_profile(ROOT / profile_path.removeprefix("/app/"), {})
        profile = with_overrides(profile, sidecar={"advertise_host": host})
        record = EngineRecord.decode(json.dumps({**describe(profile), "ready": True}).encode())
        assert record is not None and record.pool == pool.name and record.model == pool.model
        # The same name: the proxy keeps the configured engine, never a second copy of it.
        assert [(e.name, e.url) for e in pool.engines] == [(record.name, record.url)]
        svc = one(objs, "Service", pool.name)
        assert svc["spec"]["clusterIP"] == "None"  # <pod>.<service> resolves per pod
        assert one(objs, "StatefulSet", pool.name)["spec"]["serviceName"] == pool.name


@pytest.mark.parametrize("pool", ["draft", "target"])
def test_engines_warm_up_before_ready_and_drain_within_their_grace(
    rendered: dict[str, list[Obj]], pool: str
) -> None:
    objs = rendered["overlays/gpu"]
    pod, c = engine_container(objs, pool)
    profile_path, _ = advertised(c, f"{pool}-0")
    side = load_profile(ROOT / profile_path.removeprefix("/app/"), {}).sidecar
    assert pod["terminationGracePeriodSeconds"] >= (
        side.drain_timeout_s + side.drain_notice_s + side.stop_timeout_s)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": side.vllm_port, "metrics": side.port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    expected = [a for a in COMPOSE["services"][pool]["command"]]
    expected[expected.index("--advertise-host") + 1] = f"$(POD_NAME).{pool}"
    expected = [a.replace("${TARGET_PROFILE:-target}", "target") for a in expected]
    assert c["command"] == expected
    env = {e["name"] for e in c["env"]}
    assert set(COMPOSE["services"][pool]["environment"]) <= env
    pdb = one(objs, "PodDisruptionBudget", pool)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= (
        one(objs, "StatefulSet", pool)["spec"]["template"]["metadata"]["labels"].items())
