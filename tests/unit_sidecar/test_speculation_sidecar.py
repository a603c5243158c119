"""Rollouts of a real ``kvproxy-sidecar vllm`` process over the stand-in vLLM (fake_vllm/): no
request cut by a drain that runs long, no engine left behind by a SIGTERM mid-rollout, the pool
lease held while a failed rollback leaves the engine down."""

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

from unit_sidecar.sidecars import FAKE_VLLM, free_port, get, launch, metric, post, stop, wait_for

SCHEDULE = "num_speculative_tokens_per_batch_size"
NEW = [[1, 4, 2], [5, 256, 1]]


@dataclass
class Sidecar:
    proc: subprocess.Popen[bytes]
    url: str
    engine_url: str
    vllm_port: int
    control: Path

    def ready(self) -> dict[str, object]:
        return json.loads(get(self.url + "/ready")[1])

    def engine_does(self, **ways: object) -> None:
        """How the stand-in's next starts behave (see fake_vllm)."""
        self.control.write_text(json.dumps(ways))

    def engines_alive(self) -> list[int]:
        """Stand-in vLLM servers on this sidecar's vLLM port, whoever their parent."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if b"vllm.entrypoints.openai.api_server" in args and \
                    str(self.vllm_port).encode() in args and state != "Z":
                found.append(int(entry.name))
        return found


def post_schedule(sc: Sidecar, schedule: list[list[int]]) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(sc.url + "/speculation", data=json.dumps({SCHEDULE: schedule})
                                 .encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator:
    started: list[Sidecar] = []

    def start(extra_sidecar: str = "", extra_speculation: str = 'coordination = "local"'
              ) -> Sidecar:
        port, vllm_port = free_port(), free_port()
        control = tmp_path / f"control-{port}.json"
        control.write_text("{}")
        profile = tmp_path / f"fake-{port}.toml"
        profile.write_text(f"""
[engine]
model = "/models/fake"
served_model_name = "fake-model"
speculative = {{ method = "ngram", num_speculative_tokens = 3 }}
env = {{ PYTHONPATH = "{FAKE_VLLM}", FAKE_VLLM_CONTROL = "{control}" }}
[sidecar]
port = {port}
vllm_port = {vllm_port}
python = "{sys.executable}"
health_interval_s = 0.1
warmup_requests = 1
restart_initial_s = 0.2
restart_max_s = 0.5
spec_poll_s = 0.2
stop_timeout_s = 5.0
{extra_sidecar}
[speculation]
adaptive = true
poll_s = 0.2
eval_s = 100000.0
{extra_speculation}
""")
        proc = launch(profile)
        sc = Sidecar(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{vllm_port}",
                     vllm_port, control)
        started.append(sc)
        return sc

    yield start
    for sc in started:
        stop(sc.proc, timeout=20)
        for pid in sc.engines_alive():  # what a failing test left behind
            os.killpg(pid, signal.SIGKILL)


def test_a_drain_longer_than_drain_timeout_is_abandoned_without_cutting(sidecar) -> None:
    sc = sidecar("drain_timeout_s = 1.0")
    wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="sidecar ready")
    pid = sc.ready()["engine_pid"]
    result: list[object] = []

    def long_request() -> None:  # max_tokens 4000: the stand-in holds it 4 s
        try:
            result.append(post(sc.engine_url + "/v1/completions",
                               {"model": "fake-model", "max_tokens": 4000}))
        except OSError as exc:
            result.append(exc)

    worker = threading.Thread(target=long_request)
    worker.start()
    wait_for(lambda: metric(get(sc.url + "/metrics")[1], "vllm:num_requests_running") == 1,
             what="request running")
    status, body = post_schedule(sc, NEW)
    worker.join(timeout=20)
    assert result == [200], "the request running through the drain was served to its end"
    assert status == 409 and str(body["reason"]).startswith("abandoned: the drain did not end")
    assert body[SCHEDULE] != NEW
    assert sc.ready()["engine_pid"] == pid and get(sc.url + "/ready")[0] == 200
    assert sc.ready()["speculation"]["rollout"] == "idle"
    text = get(sc.url + "/metrics")[1]
    assert 'kvproxy_sidecar_spec_reconfigurations_total{result="abandoned"} 1' in text


def test_sigterm_during_a_rollout_leaves_no_engine_behind(sidecar) -> None:
    sc = sidecar()
    wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="sidecar ready")
    old = sc.ready()["engine_pid"]
    sc.engine_does(scheduled=5.0)  # the new schedule's engine loads slowly
    answers: list[object] = []

    def rollout() -> None:
        try:
            answers.append(post_schedule(sc, NEW))
        except OSError as exc:
            answers.append(exc)

    worker = threading.Thread(target=rollout)
    worker.start()
    wait_for(lambda: sc.ready().get("engine_pid") not in (old, None), what="new engine started")
    assert sc.ready()["speculation"]["rollout"] == "restarting"
    sc.proc.send_signal(signal.SIGTERM)
    assert sc.proc.wait(timeout=30) == 0
    worker.join(timeout=10)
    time.sleep(1.0)  # a start after the exit would be visible by now
    assert sc.engines_alive() == []
    assert answers and (not isinstance(answers[0], tuple) or answers[0][0] == 409)


def test_a_failed_rollback_keeps_the_pool_lease_until_the_engine_is_back(
        sidecar, redis_url: str) -> None:
    sc = sidecar(f'redis_url = "{redis_url}"', 'pool = "target:fake"')
    client = redis.Redis.from_url(redis_url)
    key = "kvproxy:spec:rollout:target:fake:0"
    try:
        wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="sidecar ready")
        sc.engine_does(scheduled="exit", unscheduled="exit")  # the rollback fails too
        status, body = post_schedule(sc, NEW)
        assert status == 409 and "so did the rollback" in str(body["reason"])
        assert body[SCHEDULE] == [[1, 256, 3]]  # what it last ran, not the one that failed
        # Down in the supervisor's backoff: still out, so the pool's lease stays taken.
        assert client.get(key) is not None
        assert sc.ready()["speculation"]["rollout"] == "failed"
        time.sleep(1.0)
        assert client.get(key) is not None
        sc.engine_does()  # the next restart succeeds
        wait_for(lambda: get(sc.url + "/ready")[0] == 200, what="back after the backoff")
        wait_for(lambda: client.get(key) is None, timeout=5, what="lease released")
        assert sc.ready()["speculation"]["rollout"] == "idle"
        assert metric(get(sc.url + "/metrics")[1],
                      "kvproxy_sidecar_spec_last_restart_seconds") >= 1.0
    finally:
        client.close()
