"""Engine behaviour the proxy relies on: priority scheduling, prefix-cache counters, speculative
decoding counters, and that closing the client connection aborts the request."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from contract.client import (
    Backend,
    Engine,
    metric,
    poll,
    post_json,
    scrape,
    settled_metric,
    value,
    wait_until,
)

# Where the simulator does not (yet) behave like vLLM 0.32 (test name -> gap); its [sim] variants
# are expected to fail until the simulator matches. The [vllm] variants are the reference.
SIM_DIVERGES: dict[str, str] = {}
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"
LONG = 2000
ATTEMPTS = 5


@contextlib.asynccontextmanager
async def open_stream(session: aiohttp.ClientSession, engine: Engine,
                      body: dict[str, Any]) -> AsyncIterator[aiohttp.ClientResponse]:
    """A streamed completion left open; leaving the block closes the connection (abort)."""
    resp = await session.post(engine.url + "/v1/completions", json={**body, "stream": True})
    try:
        assert resp.status == 200, await resp.text()
        yield resp
    finally:
        resp.close()


async def first_content(resp: aiohttp.ClientResponse) -> float:
    """Wait for the first generated text; returns the loop time it arrived."""
    async for line in resp.content:
        if line.startswith(b"data: {") and b'"text":"' in line and b'"text":""' not in line:
            return asyncio.get_running_loop().time()
    raise AssertionError("stream ended without content")


def long_body(backend: Backend, prompt: str, **extra: object) -> dict[str, Any]:
    # ignore_eos: keep generating until aborted, whatever the random weights say; nearly the
    # whole context, so a request outlives the few steps a test needs by a wide margin.
    return {"model": backend.model, "prompt": prompt, "max_tokens": LONG, "ignore_eos": True,
            "temperature": 0, **extra}


async def test_priority_orders_the_waiting_queue(backend: Backend) -> None:
    """Engine a has two slots. With both busy, ``low`` (priority 10) is queued, then ``high``
    (-10). When one slot frees, ``high`` starts although it arrived last.

    The verdict rests on the engine's own gauges, not on when streamed text reaches the test: on
    a loaded machine a stalled API server can deliver several streams' first tokens at once. With
    one of the two started, the engine still holding a waiting request means the other one
    waits. An attempt in which the blockers end on their own before the order can be read
    proves nothing either way and is repeated."""
    notes: list[str] = []
    for _ in range(ATTEMPTS):
        verdict = await _priority_attempt(backend)
        if verdict is None:
            return
        notes.append(verdict)
        await wait_until(lambda: _idle(backend.a), what="engine a idle")
    pytest.fail(f"{ATTEMPTS} attempts were inconclusive: " + "; ".join(notes))


class _Tracked:
    """One open stream, read in the background; ``started`` once generated text arrived."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.started = False
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(aiohttp.ClientError, AssertionError):
            await first_content(self.resp)
            self.started = True
            async for _ in self.resp.content:
                pass

    async def stop(self) -> None:
        self.resp.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def _priority_attempt(backend: Backend) -> str | None:
    """None: high went first; a reason: inconclusive; AssertionError: low went first."""
    a = backend.a
    url = a.engine_metrics_url or a.metrics_url
    async with aiohttp.ClientSession() as s, contextlib.AsyncExitStack() as stack:

        async def submit(name: str, **extra: object) -> _Tracked:
            # Sampled: n-gram speculation rarely matches sampled text, so these decode slowly.
            body = long_body(backend, name, temperature=1.0, **extra)
            t = _Tracked(await stack.enter_async_context(open_stream(s, a, body)))
            stack.push_async_callback(t.stop)
            return t

        blockers = [await submit(f"blocker {i}") for i in range(2)]
        await wait_until(lambda: _true(all(b.started for b in blockers)), what="blockers started")
        low = await submit("low", priority=10)
        high = await submit("high", priority=-10)
        # No other request exists: two waiting means both are queued behind the blockers.
        if not await poll(lambda: _gauge_at_least(url, WAITING, 2), 20):
            return "low and high were not both seen waiting"
        await blockers[0].stop()  # frees exactly one slot
        await wait_until(lambda: _true(high.started or low.started), timeout_s=60,
                         what="a queued request to start")
        waiting = await metric(url, WAITING)
        if waiting < 1 or (high.started and low.started):
            return "the other blocker ended too: both started"
        assert high.started, "the low-priority request started while the high-priority one waited"
        return None


async def _true(value: bool) -> bool:
    return value


async def _gauge_at_least(url: str, name: str, n: float) -> bool:
    return await metric(url, name) >= n


async def _idle(engine: Engine) -> bool:
    samples = await scrape(engine.engine_metrics_url or engine.metrics_url)
    return value(samples, RUNNING) + value(samples, WAITING) == 0


async def test_priority_on_fcfs_engine_is_accepted(backend: Backend) -> None:
    """vLLM 0.32 accepts (and ignores) ``priority`` without priority scheduling."""
    body = {"model": backend.model, "prompt": "hello", "max_tokens": 2, "priority": 5}
    status, reply = await post_json(backend.b.url + "/v1/completions", body)
    assert status == 200, reply


async def _at_most(engine: Engine, name: str, n: float) -> bool:
    return await metric(engine.metrics_url, name) <= n


async def _at_least(engine: Engine, name: str, n: float) -> bool:
    return await metric(engine.metrics_url, name) >= n


async def test_prefix_cache_hits_on_repeated_prompt(backend: Backend) -> None:
    engine = backend.b
    prompt = " ".join(f"block {i} of a long shared system prompt about routing." for i in range(40))
    body = {"model": backend.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    status, first = await post_json(engine.url + "/v1/completions", body)
    assert status == 200
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 4 * backend.block_size
    before = await scrape(engine.metrics_url)
    status, _ = await post_json(engine.url + "/v1/completions", body)
    assert status == 200
    after = await scrape(engine.metrics_url)
    queries = value(after, "vllm:prefix_cache_queries_total") - value(
        before, "vllm:prefix_cache_queries_total")
    hits = value(after, "vllm:prefix_cache_hits_total") - value(
        before, "vllm:prefix_cache_hits_total")
    # Counted in tokens: the repeated prompt hits every full block it spans (the last token
    # is always recomputed).
    assert queries == pytest.approx(prompt_tokens, abs=backend.block_size)
    full_blocks = (prompt_tokens - 1) // backend.block_size
    assert hits >= full_blocks * backend.block_size
    assert hits <= queries


SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total")


async def _spec_deltas(engine: Engine, body: dict[str, Any]) -> dict[str, float]:
    before = await scrape(engine.metrics_url)
    status, reply = await post_json(engine.url + "/v1/completions", body)
    assert status == 200, reply
    after = await scrape(engine.metrics_url)
    deltas = {n: value(after, n) - value(before, n) for n in SPEC}
    k = 0
    while any(s.labels.get("position") == str(k) for s in after
              if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        deltas[f"pos{k}"] = value(after, name, position=str(k)) - value(
            before, name, position=str(k))
        k += 1
    return deltas


def _check_spec_invariants(d: dict[str, float], k: int) -> None:
    drafts, proposed, accepted = (d[n] for n in SPEC)
    assert drafts > 0, "speculation ran"
    assert drafts <= proposed <= k * drafts
    assert 0 <= accepted <= proposed
    per_pos = [d[f"pos{i}"] for i in range(k)]
    assert sum(per_pos) == accepted
    # A position is only reached when every earlier one was accepted.
    assert all(x >= y for x, y in itertools.pairwise(per_pos))


async def test_spec_decode_counters_ngram(backend: Backend) -> None:
    text = "the cache holds the prefix and the prefix holds the cache " * 6
    body = {"model": backend.model, "prompt": text, "max_tokens": 64, "ignore_eos": True,
            "temperature": 0}
    _check_spec_invariants(await _spec_deltas(backend.a, body), backend.num_speculative_tokens)


async def test_spec_decode_counters_draft_model(backend: Backend) -> None:
    body = {"model": backend.model, "prompt": "Once upon a time there lived", "max_tokens": 64,
            "ignore_eos": True, "temperature": 0}
    d = await _spec_deltas(backend.b, body)
    _check_spec_invariants(d, backend.num_speculative_tokens)
    # A draft model proposes the full draft length at every step.
    assert d["vllm:spec_decode_num_draft_tokens_total"] == (
        backend.num_speculative_tokens * d["vllm:spec_decode_num_drafts_total"])


async def test_client_disconnect_aborts_the_request(backend: Backend) -> None:
    """An attempt in which the whole request was generated before the engine's API server saw
    the disconnect (a loaded machine can starve it while the engine core steps on) is repeated;
    an engine that never aborts runs every attempt to its end and fails."""
    ran: list[float] = []
    for _ in range(ATTEMPTS):
        generated = await _disconnect_attempt(backend.b, backend)
        assert generated > 0, "the request never ran"
        if generated < LONG:
            return
        ran.append(generated)
    pytest.fail(f"every request ran to its end after the client left: {ran}")


async def _disconnect_attempt(engine: Engine, backend: Backend) -> float:
    """Tokens the engine generated for one request whose client left after five lines."""
    async with aiohttp.ClientSession() as s:
        await wait_until(lambda: _at_most(engine, RUNNING, 0), what="engine b idle")
        before = await metric(engine.metrics_url, GENERATED)
        async with open_stream(s, engine, long_body(backend, "abort me")) as resp:
            for _ in range(5):
                await resp.content.readline()
        # Closed as soon as tokens flow: every moment it stays open lets the engine run on toward
        # LONG. vLLM's running gauge can trail the streamed tokens on a loaded machine, so the
        # verdict rests on the token counter: it must settle short of the whole request.
        await wait_until(lambda: _at_most(engine, RUNNING, 0), timeout_s=20,
                         what="running count to drop after disconnect")
    return await settled_metric(engine.metrics_url, GENERATED) - before
