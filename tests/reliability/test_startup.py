"""Start-up: the proxy listens only once its first scrape round has ended, so that its first
request is routed (a worker restarted under ``--workers N`` joins the shared port while clients
send), and an engine that never answers delays listening by one round's timeout, no more."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp
import openai
from integration.stack import TARGET_MODEL, proxy_config

from proxy.core.config import TelemetryConfig
from proxy.server.app import build_app
from proxy.server.lifecycle import ProxyServer

from .rogue import RogueEngine
from .test_telemetry_trust import until


async def test_the_first_request_after_start_is_routed() -> None:
    engine = RogueEngine()
    await engine.start()
    engine.behaviour.metrics_hold = True  # the first scrape is answered when the test says
    telemetry = TelemetryConfig(interval_s=5.0, timeout_s=4.0, stale_after_s=5.0)
    cfg = proxy_config([engine.url], ["e0"], ["target"], telemetry=telemetry)
    server = ProxyServer(cfg, app=build_app(cfg))
    starting = asyncio.ensure_future(server.start())
    try:
        await until(lambda: bool(engine.requests_to("/metrics")))
        await asyncio.sleep(0.2)
        assert not starting.done(), "listening before the engine's health is known"
        assert server.port == 0
        engine.behaviour.metrics_hold = False
        engine.release.set()
        await asyncio.wait_for(starting, 5.0)
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test",
                                    max_retries=0)  # fmt: skip
        async with client:
            reply = await client.chat.completions.create(
                model=TARGET_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content
    finally:
        if not starting.done():
            starting.cancel()
        await server.stop()
        await engine.stop()


async def test_an_engine_that_never_answers_delays_listening_by_one_timeout() -> None:
    engine = RogueEngine()
    await engine.start()
    engine.behaviour.metrics_hold = True  # never released
    telemetry = TelemetryConfig(interval_s=0.5, timeout_s=0.3, stale_after_s=1.0)
    cfg = proxy_config([engine.url], ["e0"], ["target"], telemetry=telemetry)
    server = ProxyServer(cfg, app=build_app(cfg))
    began = time.monotonic()
    try:
        await asyncio.wait_for(server.start(), 5.0)
        waited = time.monotonic() - began
        # One timeout, and at most one more if the loop ran late; never the start-up's cap.
        assert 0.25 <= waited < 2 * 2 * 0.3, waited
        async with aiohttp.ClientSession() as http, http.get(server.url + "/ready") as resp:
            assert resp.status == 503
            assert (await resp.json())["reason"] == "no routable engine"
    finally:
        engine.release.set()
        await server.stop()
        await engine.stop()


async def test_a_stop_signal_during_start_up_is_a_clean_stop(tmp_path: Path) -> None:
    # The first scrape round waits on an engine that does not answer its metrics (up to four
    # timeouts): a SIGTERM then must end in a drained stop and exit 0, not the default death.
    engine = RogueEngine()
    await engine.start()
    engine.behaviour.metrics_hold = True
    config = tmp_path / "kvproxy.toml"
    config.write_text(
        '[server]\nhost = "127.0.0.1"\nport = 0\n\n[telemetry]\ninterval_s = 1.5\n'
        'timeout_s = 1.0\nstale_after_s = 2.0\n\n[[pools]]\nname = "target"\n'
        f'model = "{TARGET_MODEL}"\n\n[[pools.engines]]\nname = "e0"\nurl = "{engine.url}"\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config),
        stderr=asyncio.subprocess.PIPE)
    try:
        await until(lambda: bool(engine.requests_to("/metrics")), timeout_s=30.0)
        proc.send_signal(signal.SIGTERM)  # inside start-up: its first round is not over
        async with asyncio.timeout(20):
            code = await proc.wait()
        assert proc.stderr is not None
        log = (await proc.stderr.read()).decode()
        assert code == 0, log
        assert "SIGTERM received" in log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await engine.stop()
