"""The vLLM sidecar in front of real engines: readiness, re-exported metrics, derived speculative
figures, and the drain on SIGTERM. Real vLLM only (the simulator has no sidecar)."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from contract.client import Backend, post_json, scrape, scrape_text, value, wait_until
from contract.conftest import STARTUP_TIMEOUT_S

BACKENDS = ("vllm",)
# The drain test stops engine b's sidecar, so it is moved behind every other test (conftest.py).
RUNS_LAST = ("test_killed_vllm_is_restarted", "test_sigterm_drains_then_stops_vllm")


async def _ready(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/ready") as resp:
        return resp.status, await resp.json()


async def test_ready_advertises_the_engine_url(backend: Backend) -> None:
    for engine, policy in ((backend.a, "priority"), (backend.b, "fcfs")):
        assert engine.sidecar_url is not None
        status, info = await _ready(engine.sidecar_url)
        assert status == 200
        assert info["ready"] is True and info["draining"] is False
        assert info["engine_url"] == engine.url
        assert info["model"] == backend.model and info["role"] == "target"
        assert info["scheduling_policy"] == policy
        assert info["num_speculative_tokens"] == backend.num_speculative_tokens


async def test_metrics_reexport_every_vllm_series(backend: Backend) -> None:
    engine = backend.a
    assert engine.engine_metrics_url is not None
    direct = {s.name for s in await scrape(engine.engine_metrics_url)}
    through = await scrape(engine.metrics_url)
    assert direct <= {s.name for s in through}
    assert value(through, "kvproxy_sidecar_ready") == 1
    assert value(through, "kvproxy_sidecar_draining") == 0
    assert value(through, "kvproxy_sidecar_engine_up") == 1
    assert value(through, "kvproxy_sidecar_engine_restarts_total") == 0


async def test_derived_speculative_figures(backend: Backend) -> None:
    engine, k = backend.b, backend.num_speculative_tokens
    body = {"model": backend.model, "prompt": "There lived a model", "max_tokens": 48,
            "ignore_eos": True, "temperature": 0}
    for _ in range(2):
        status, _ = await post_json(engine.url + "/v1/completions", body)
        assert status == 200

    async def derived() -> bool:
        samples = await scrape(engine.metrics_url)
        return value(samples, "kvproxy_sidecar_spec_window_drafts") > 0

    await wait_until(derived, timeout_s=30, what="spec window to cover drafts")
    samples = await scrape(engine.metrics_url)
    rate = value(samples, "kvproxy_sidecar_spec_acceptance_rate")
    length = value(samples, "kvproxy_sidecar_spec_mean_acceptance_length")
    per_pos = [value(samples, "kvproxy_sidecar_spec_acceptance_per_position", position=str(i))
               for i in range(k)]
    best = value(samples, "kvproxy_sidecar_spec_best_num_speculative_tokens")
    assert 0.0 <= rate <= 1.0
    assert 1.0 <= length <= k + 1
    assert all(0.0 <= p <= 1.0 for p in per_pos)
    assert per_pos == sorted(per_pos, reverse=True)
    assert length == pytest.approx(1.0 + sum(per_pos))
    assert best == int(best) and best >= 0
    assert value(samples, "kvproxy_sidecar_spec_num_speculative_tokens") == k


async def test_killed_vllm_is_restarted(backend: Backend) -> None:
    engine = backend.a
    assert engine.sidecar_url is not None
    _, info = await _ready(engine.sidecar_url)
    old_pid = info["engine_pid"]
    assert isinstance(old_pid, int)
    os.kill(old_pid, signal.SIGKILL)  # the API server only: its engine-core children remain

    async def not_ready() -> bool:
        return (await _ready(engine.sidecar_url))[0] == 503  # type: ignore[arg-type]

    await wait_until(not_ready, timeout_s=30, what="sidecar to notice the crash")

    async def ready_again() -> bool:
        status, info = await _ready(engine.sidecar_url)  # type: ignore[arg-type]
        return status == 200 and info["engine_pid"] != old_pid

    await wait_until(ready_again, timeout_s=STARTUP_TIMEOUT_S, what="vLLM restarted and ready")
    _, info = await _ready(engine.sidecar_url)
    assert info["restarts"] == 1
    # The sidecar took the crashed server's whole process group down before restarting.
    with pytest.raises(ProcessLookupError):
        os.killpg(old_pid, 0)
    text = await scrape_text(engine.metrics_url)
    assert "kvproxy_sidecar_engine_restarts_total 1" in text
    status, _ = await post_json(engine.url + "/v1/completions",
                                {"model": backend.model, "prompt": "back", "max_tokens": 2})
    assert status == 200


async def test_sigterm_drains_then_stops_vllm(backend: Backend) -> None:
    engine = backend.b
    proc = backend.procs[1]
    assert engine.sidecar_url is not None
    _, info = await _ready(engine.sidecar_url)
    engine_pid = info["engine_pid"]
    assert isinstance(engine_pid, int)
    body = {"model": backend.model, "prompt": "drain", "max_tokens": 400, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(engine.url + "/v1/completions",
                                                   json=body) as resp:
        await resp.content.readline()
        proc.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            status, info = await _ready(engine.sidecar_url)  # type: ignore[arg-type]
            return status == 503 and info["draining"] is True

        await wait_until(draining, timeout_s=10, what="sidecar to report draining")
        text = await scrape_text(engine.metrics_url)
        assert "kvproxy_sidecar_draining 1" in text and "kvproxy_sidecar_ready 0" in text
        # The in-flight request runs to its end while the sidecar waits.
        raw = (await resp.read()).decode()
    assert raw.rstrip().endswith("data: [DONE]")
    assert '"completion_tokens":400' in raw
    loop = asyncio.get_running_loop()
    code = await loop.run_in_executor(None, proc.wait, 90)
    assert code == 0
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)
