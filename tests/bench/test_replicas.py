"""The replica benchmark: its pure parts (arms, HAProxy config and stats, replica config), its
report, and a few seconds of a real run: 2 replicas behind HAProxy in front of simulated engines."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import missing

from bench.front import HAPROXY, Arm, haproxy_config, haproxy_requests, parse_arms, replica_config
from bench.machine import read_json
from bench.report_replicas import replicas_markdown
from proxy.core.configload import load_config

ROOT = Path(__file__).resolve().parents[2]
MACHINE = {"nproc": 2, "cpu_model": "Test CPU", "kernel": "6", "python": "3.11",
           "memory_gib": 24.0, "load_avg_at_start": [2.5, 2.4, 2.3]}


def test_arms_parse_and_bad_ones_are_refused() -> None:
    arms = parse_arms("haproxy-1, haproxy-4-shared,haproxy-4-alone,direct-1,haproxy-4-shared")
    assert [a.name for a in arms] == ["haproxy-1", "haproxy-4-shared", "haproxy-4-alone",
                                      "direct-1"]
    assert arms[2] == Arm(4, haproxy=True, sharing=False)
    for bad in ("direct-2", "haproxy-0", "haproxy-2-maybe", "nginx-1", "direct-1-alone"):
        with pytest.raises(ValueError, match="unknown arm"):
            parse_arms(bad)


def test_haproxy_config_balances_round_robin_over_every_replica_on_loopback() -> None:
    text = haproxy_config(8080, 8081, [9001, 9002, 9003], timeout_s=200.0)
    assert "mode http" in text and "balance roundrobin" in text
    assert [ln.split()[-1] for ln in text.splitlines() if ln.strip().startswith("server ")] == [
        "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]
    assert "bind 127.0.0.1:8080" in text and "bind 127.0.0.1:8081" in text
    assert "timeout server 200s" in text


def test_haproxy_stats_csv_gives_requests_per_server() -> None:
    csv = "\n".join([
        "# pxname,svname,qcur,stot,req_tot,",
        "kvproxy,FRONTEND,,40,40,", "replicas,r0,0,21,21,", "replicas,r1,0,19,19,",
        "replicas,BACKEND,0,40,40,", "stats,FRONTEND,,1,1,"])
    assert haproxy_requests(csv) == {"r0": 21.0, "r1": 19.0}
    assert haproxy_requests("not csv") == {}


def test_replica_config_is_a_valid_kvproxy_config(tmp_path: Path) -> None:
    for sharing in (True, False):
        path = tmp_path / f"replica-{sharing}.toml"
        path.write_text(replica_config(9000, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "m",
                                       "redis://127.0.0.1:6379/0", "kvproxy:bench:x:", sharing))
        cfg = load_config(str(path), {}, [])
        assert cfg.sharing.enabled is sharing and cfg.redis.url.startswith("redis://")
        assert [e.name for e in cfg.pools[0].engines] == ["e0", "e1"]


def _run(workload: str, arm: str, p90: float, hit: float, rnd: int = 0) -> dict[str, object]:
    return {"workload": workload, "arm": arm, "round": rnd, "status": "ok",
            "summary": {"ttft_p50": p90 / 2, "ttft_p90": p90, "ttft_p99": p90 * 2,
                        "completed": 10.0, "requests": 10.0},
            "hit_rate": hit, "router_cpu_s": 1.0, "duration_s": 10.0,
            "replica_requests": [5.0, 5.0], "haproxy_requests": {"r0": 5.0, "r1": 5.0}}


def test_report_judges_four_replicas_against_one_round_by_round() -> None:
    runs = [_run("rag", "haproxy-1", 2.0, 0.6), _run("rag", "haproxy-4-shared", 2.1, 0.58),
            _run("rag", "haproxy-1", 2.0, 0.6, 1), _run("rag", "haproxy-4-shared", 2.4, 0.5, 1),
            _run("chat", "haproxy-1", 1.0, 0.5),
            _run("unique", "haproxy-1", 2.0, 0.0), _run("unique", "haproxy-4-shared", 2.1, 0.0)]
    data = {"command": "python -m bench.replicas", "machine": MACHINE, "versions": {},
            "settings": {"arms": ["haproxy-1", "haproxy-4-shared"], "policy": "expected_ttft",
                         "balance": "roundrobin", "engines": 8, "profile": "p",
                         "engine_cores": "1", "router_cores": "0", "slice_fraction": 0.5,
                         "rate_scale_override": None, "time_scale": 3.0, "repeat": 2},
            "workloads": [{"name": "rag"}, {"name": "chat"}, {"name": "unique"}], "runs": runs,
            "load_avg_at_end": [3.0, 2.0, 1.0]}
    text = replicas_markdown(data)
    # Round 1: p90 x1.05, hit x0.97; round 2: p90 x1.20, hit x0.83; medians 1.12 and 0.90.
    assert "- `rag`: missed on the medians — p90 ratio 1.12 [1.05-1.20] (≤ 1.10 in 1 of 2" in text
    assert "hit-rate ratio 0.90 [0.83-0.97] (≥ 0.90 in 1 of 2 rounds)" in text
    assert "- `chat`: not measured" in text
    assert ("- `unique`: met on the medians — p90 ratio 1.05 (≤ 1.10 in 1 of 1 rounds), no prefix "
            "reuse, so no hit rate to keep") in text
    assert "| `haproxy-4-shared` | 1.12 [1.05-1.20] | 2.25 [2.10-2.40] |" in text
    assert "load average at the end 3.00 2.00 1.00" in text


@pytest.mark.timeout(240)
def test_a_short_run_goes_through_haproxy_to_both_replicas(tmp_path: Path) -> None:
    if not Path(HAPROXY).exists():
        missing(f"{HAPROXY} is not installed (scripts/setup.sh --haproxy)")
    if shutil.which("redis-server") is None:
        missing("redis-server is not installed (scripts/setup.sh --redis)")
    argv = [sys.executable, "-m", "bench.replicas", "--arms", "haproxy-2-shared",
            "--workloads", "rag", "--rate-scale", "2", "--slice-fraction", "0.05",
            "--engines", "2", "--time-scale", "20", "--request-timeout-s", "60",
            "--engine-cores", "", "--router-cores", "", "--no-report", "--out", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=200,
                          check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = read_json(tmp_path / "replicas.json")
    assert data["settings"]["arms"] == ["haproxy-2-shared"]  # type: ignore[index]
    [run] = data["runs"]  # type: ignore[misc]
    assert run["status"] == "ok", run.get("error")
    assert (run["workload"], run["arm"], run["replicas"], run["sharing"]) == (
        "rag", "haproxy-2-shared", 2, True)
    summary = run["summary"]
    assert summary["completed"] == summary["requests"] > 0
    assert not math.isnan(summary["ttft_p90"]) and 0 <= run["hit_rate"] <= 1
    # Through HAProxy to both replicas: each one answered requests, and HAProxy counted them.
    assert len(run["replica_requests"]) == 2 and min(run["replica_requests"]) > 0
    assert sorted(run["haproxy_requests"]) == ["r0", "r1"]
    assert min(run["haproxy_requests"].values()) > 0
    assert sum(run["replica_requests"]) == summary["requests"]
    assert "finished_at" in data
