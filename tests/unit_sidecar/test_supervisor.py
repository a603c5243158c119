"""The sidecar process end to end, supervising a stand-in vLLM server (fake_vllm/).

Real sockets on 127.0.0.1; the real-vLLM version of these checks lives in tests/contract.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from unit_sidecar.sidecars import (
    FAKE_VLLM,
    alive,
    free_port,
    get,
    launch,
    metric,
    post,
    stop,
    wait_for,
)


@dataclass
class Sidecar:
    proc: subprocess.Popen[bytes]
    url: str
    engine_url: str

    def ready(self) -> dict[str, object]:
        return json.loads(get(self.url + "/ready")[1])


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator:
    started: list[subprocess.Popen[bytes]] = []

    def start(extra_sidecar: str = "", crash_marker: Path | None = None,
              python: str = sys.executable, restart_initial_s: float = 0.2,
              restart_max_s: float = 1.0, start_log: Path | None = None) -> Sidecar:
        port, vllm_port = free_port(), free_port()
        env_line = f'PYTHONPATH = "{FAKE_VLLM}"'
        if crash_marker is not None:
            env_line += f', FAKE_VLLM_CRASH_MARKER = "{crash_marker}"'
        if start_log is not None:
            env_line += f', FAKE_VLLM_START_LOG = "{start_log}"'
        profile = tmp_path / f"fake-{port}.toml"
        profile.write_text(f"""
[engine]
model = "/models/fake"
served_model_name = "fake-model"
speculative = {{ method = "ngram", num_speculative_tokens = 3 }}
env = {{ {env_line} }}
[sidecar]
port = {port}
vllm_port = {vllm_port}
python = "{python}"
health_interval_s = 0.1
warmup_requests = 2
restart_initial_s = {restart_initial_s}
restart_max_s = {restart_max_s}
spec_poll_s = 0.2
drain_timeout_s = 10.0
stop_timeout_s = 5.0
{extra_sidecar}
""")
        proc = launch(profile)
        started.append(proc)
        return Sidecar(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{vllm_port}")

    yield start
    for proc in started:
        stop(proc, timeout=15)


def test_ready_after_health_and_warm_up_and_advertises_engine_url(sidecar_factory) -> None:
    sc = sidecar_factory()
    wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="sidecar ready")
    info = sc.ready()
    assert info["engine_url"] == sc.engine_url
    assert info["model"] == "fake-model" and info["role"] == "target"
    assert get(sc.url + "/health")[0] == 200
    status, text = get(sc.url + "/metrics")
    assert status == 200
    # vLLM's own series come through unchanged, followed by the derived ones.
    assert 'vllm:num_requests_running{engine="0",model_name="fake-model"}' in text
    assert metric(text, "kvproxy_sidecar_ready") == 1
    assert metric(text, "kvproxy_sidecar_draining") == 0


def test_spec_window_derives_acceptance(sidecar_factory) -> None:
    sc = sidecar_factory()
    wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="sidecar ready")
    for _ in range(3):
        post(sc.engine_url + "/v1/completions", {"model": "fake-model", "max_tokens": 1})
        time.sleep(0.3)
    text = get(sc.url + "/metrics")[1]
    # The stand-in reports 10 drafts, 30 draft tokens, 18 accepted (8/6/4 by position) per request.
    assert metric(text, "kvproxy_sidecar_spec_acceptance_rate") == pytest.approx(0.6)
    assert metric(text, "kvproxy_sidecar_spec_mean_acceptance_length") == pytest.approx(2.8)
    assert 'kvproxy_sidecar_spec_acceptance_per_position{position="0"} 0.8' in text
    assert metric(text, "kvproxy_sidecar_spec_best_num_speculative_tokens") == 3


def test_engine_crash_is_restarted_with_backoff(sidecar_factory, tmp_path: Path) -> None:
    marker, starts = tmp_path / "crash-once", tmp_path / "starts"
    marker.write_text("")
    sc = sidecar_factory(crash_marker=marker, restart_initial_s=1.5, restart_max_s=3.0,
                         start_log=starts)
    wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="ready after a crashed first start")
    assert sc.ready()["restarts"] == 1
    assert metric(get(sc.url + "/metrics")[1], "kvproxy_sidecar_engine_restarts_total") == 1
    # The restart waited out the back-off: the second start came at least restart_initial_s
    # after the first one began (which crashed at once). A lower bound only: load makes it later.
    first, second = (float(t) for t in starts.read_text().split())
    assert second - first >= 1.5, f"restarted {second - first:.2f} s after the crashed start"
    assert "restart 1 in 1.5 s" in sc.ready()["events"]


def test_missing_interpreter_keeps_retrying_and_never_reports_ready(sidecar_factory,
                                                                    tmp_path: Path) -> None:
    launched = time.monotonic()
    sc = sidecar_factory(python=str(tmp_path / "no-such-python"), restart_initial_s=0.5,
                         restart_max_s=2.0)
    # ``before_first``: when the last poll that still saw no restart was sent (the first restart
    # came after it); ``seen_third``: when a poll first saw the third. Between the first and the
    # third restart lie the first two delays (0.5 s, then 1.0 s), so no less than 1.5 s.
    before_first, seen_third, restarts = launched, None, 0
    deadline = launched + 30.0
    while time.monotonic() < deadline:
        sent = time.monotonic()
        status, body = get(sc.url + "/ready")
        restarts = json.loads(body)["restarts"] if body else 0
        if restarts == 0:
            before_first = sent
        elif restarts >= 3:
            seen_third = time.monotonic()
            break
        time.sleep(0.05)
    assert seen_third is not None, f"only {restarts} restarts in 30 s"
    assert status == 503
    assert seen_third - before_first >= 1.5, \
        f"3 restarts within {seen_third - before_first:.2f} s: no back-off between them"
    info = sc.ready()
    assert info["engine_up"] is False
    # The delays grow as documented: doubling from restart_initial_s, capped at restart_max_s.
    assert [e for e in info["events"] if e.startswith("restart ")][:3] == [
        "restart 1 in 0.5 s", "restart 2 in 1.0 s", "restart 3 in 2.0 s"], info["events"]
    assert get(sc.url + "/health")[0] == 200


def test_engine_killed_while_ready_comes_back(sidecar_factory) -> None:
    sc = sidecar_factory()
    wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="sidecar ready")
    pid = int(sc.ready()["engine_pid"])
    child = json.loads(get(sc.engine_url + "/child")[1])["pid"]
    os.kill(pid, signal.SIGKILL)  # the server only: its child is left behind
    wait_for(lambda: sc.ready().get("engine_pid") not in (pid, None)
             and get(sc.url + "/ready")[0] == 200, what="engine restarted")
    assert sc.ready()["restarts"] == 1
    # The crashed server's process group, child included, was killed before the restart.
    wait_for(lambda: not alive(child), timeout=5, what="orphaned child killed")


def test_sigterm_drains_in_flight_requests_then_stops_engine(sidecar_factory) -> None:
    sc = sidecar_factory()
    wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="sidecar ready")
    engine_pid = int(sc.ready()["engine_pid"])
    result: list[int] = []
    # max_tokens 3000: the stand-in holds this request for 3 s.
    worker = threading.Thread(target=lambda: result.append(
        post(sc.engine_url + "/v1/completions", {"model": "fake-model", "max_tokens": 3000})))
    worker.start()
    wait_for(lambda: metric(get(sc.url + "/metrics")[1], "vllm:num_requests_running") == 1,
             what="request running")
    sc.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: sc.ready().get("draining") is True, what="draining reported")
    status, _ = get(sc.url + "/ready")
    assert status == 503
    assert metric(get(sc.url + "/metrics")[1], "kvproxy_sidecar_draining") == 1
    worker.join(timeout=20)
    assert result == [200], "the in-flight request finished during the drain"
    assert sc.proc.wait(timeout=20) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)


def test_idle_engine_keeps_serving_while_the_drain_is_announced(sidecar_factory) -> None:
    # Proxies learn of a drain from their next scrape: until they have had time to, a request
    # routed to this engine must still be answered, even though the engine is idle.
    sc = sidecar_factory(extra_sidecar="drain_notice_s = 5.0")
    wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="sidecar ready")
    sc.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    wait_for(lambda: sc.ready().get("draining") is True, what="draining reported")
    assert post(sc.engine_url + "/v1/completions", {"model": "fake-model", "max_tokens": 1}) == 200
    assert time.monotonic() - signalled < 5.0, "the request was sent inside the notice period"
    assert sc.proc.wait(timeout=20) == 0
    assert time.monotonic() - signalled >= 5.0


def test_engine_registered_in_redis_with_ttl_and_removed_on_drain(sidecar_factory,
                                                                   redis_url: str) -> None:
    sc = sidecar_factory(f'redis_url = "{redis_url}"\nheartbeat_ttl_s = 3.0')
    client = redis.Redis.from_url(redis_url)
    try:
        key = f"kvproxy:engine:target:{sc.engine_url}"
        wait_for(lambda: client.exists(key) and json.loads(client.get(key))["ready"],
                 what="registry entry reporting ready")
        entry = json.loads(client.get(key))
        assert entry["engine_url"] == sc.engine_url and entry["model"] == "fake-model"
        assert 0 < client.pttl(key) <= 3000
        sc.proc.send_signal(signal.SIGTERM)
        assert sc.proc.wait(timeout=20) == 0
        assert not client.exists(key)
    finally:
        client.close()


def test_a_schedule_body_nested_too_deep_is_a_400(sidecar_factory) -> None:
    sc = sidecar_factory(
        extra_sidecar='\n[speculation]\nadaptive = true\ncoordination = "local"\n')
    wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="sidecar ready")
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"schedule": [[1, 256, ' + b"9" * 40 + b"]]}"):
        req = urllib.request.Request(sc.url + "/speculation", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        info.value.close()  # the error holds the answer's connection
        assert info.value.code == 400
    assert sc.proc.poll() is None
