"""Speculative-first aliases on the loopback stack: the draft pool writes, the target verifies.

The simulator's draft engine agrees with the target's greedy tokens with a set probability, and
its target continues any prefix of its own answer consistently, so every speculative answer must
equal the target's own answer, byte for byte.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from engine_sidecar.sim.cluster import SimCluster, start_cluster
from engine_sidecar.sim.config import SimEngineConfig
from proxy.core.config import Config
from proxy.core.errors import ConfigError
from proxy.core.fleet_config import AliasConfig, EngineConfig, PoolConfig
from proxy.server.lifecycle import ProxyServer

from .stack import FAST, proxy_config

ALIAS = "sf"
TARGET = "target-model"
DRAFT = "draft-model"


@dataclasses.dataclass
class SpecStack:
    cluster: SimCluster
    server: ProxyServer
    http: aiohttp.ClientSession

    async def post(self, body: dict[str, Any], path: str = "/v1/chat/completions",
                   **headers: str) -> tuple[aiohttp.ClientResponse, bytes]:
        async with self.http.post(self.server.url + path, json=body, headers=headers) as resp:
            return resp, await resp.read()

    async def metric(self, name: str, **labels: str) -> float:
        async with self.http.get(self.server.url + "/metrics") as resp:
            text = await resp.text()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in
                                                   labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    async def faults(self, index: int, **faults: Any) -> None:
        url = self.cluster.urls[index] + "/admin/faults"
        async with self.http.post(url, json=faults) as resp:
            assert resp.status == 200


Factory = Callable[..., Awaitable[SpecStack]]


def _alias(**kw: Any) -> AliasConfig:
    return AliasConfig(ALIAS, mode="speculative_first", draft="draft", target="target", **kw)


@pytest.fixture
async def spec_stack() -> AsyncIterator[Factory]:
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make(agreement: float = 0.8, alias: dict[str, Any] | None = None,
                   stop_len: tuple[int, int] = (6, 40), **engine: Any) -> SpecStack:
        common = {"time_scale": FAST, "stop_len_range": stop_len, "profile": "llama8b-h100",
                  **engine}
        configs = [SimEngineConfig(model=TARGET, name="t0", **common),
                   SimEngineConfig(model=DRAFT, name="d0", draft_agreement=agreement, **common)]
        cluster = await start_cluster(configs, host="127.0.0.1", port=0)
        cleanups.append(cluster.close)
        base = proxy_config(cluster.urls, ["t0", "d0"], ["target", "draft"])
        cfg = dataclasses.replace(base, aliases=(_alias(**(alias or {})),))
        server = ProxyServer(cfg)
        await server.start()
        cleanups.append(server.stop)
        http = aiohttp.ClientSession()
        cleanups.append(http.close)
        return SpecStack(cluster, server, http)

    yield make
    for cleanup in reversed(cleanups):
        await cleanup()


def _prompts(n: int) -> list[str]:
    topics = ["the cache", "a queue", "prefix blocks", "the fleet", "tenants", "drafts"]
    return [f"Question {i}: tell me about {topics[i % len(topics)]} " + "and more " * (i % 7)
            for i in range(n)]


def _sse_text(raw: bytes, chat: bool) -> tuple[str, list[str]]:
    """The concatenated answer text of an SSE body, and its finish reasons."""
    text, finishes = [], []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = orjson.loads(line[6:])
        for choice in event.get("choices", []):
            piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
            text.append(piece or "")
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    return "".join(text), finishes


Answer = tuple[str, str, dict[str, Any] | None, aiohttp.ClientResponse]


async def _answer(stack: SpecStack, model: str, prompt: str, *, chat: bool, stream: bool,
                  max_tokens: int) -> Answer:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp, raw = await stack.post(body, path)
    assert resp.status == 200, raw
    if stream:
        text, finishes = _sse_text(raw, chat)
        usage = next((orjson.loads(line[6:]).get("usage") for line in raw.split(b"\n")
                      if line.startswith(b"data: {") and b'"usage"' in line), None)
        assert len(finishes) == 1
        return text, finishes[0], _counts(usage), resp
    data = orjson.loads(raw)
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return text, choice["finish_reason"], _counts(data["usage"]), resp


def _counts(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return None if usage is None else {k: usage[k] for k in keys}


@pytest.mark.parametrize("agreement", [1.0, 0.7, 0.2])
async def test_greedy_answers_equal_the_target_alone(spec_stack: Factory,
                                                     agreement: float) -> None:
    # fallback off (rejection 1.0): every request below is drafted, whatever the agreement
    stack = await spec_stack(agreement, alias={"fallback_rejection": 1.0})
    for i, prompt in enumerate(_prompts(24)):
        chat, stream = i % 2 == 0, i % 3 == 0
        max_tokens = 8 + 5 * (i % 8)
        want = await _answer(stack, TARGET, prompt, chat=chat, stream=stream,
                             max_tokens=max_tokens)
        got = await _answer(stack, ALIAS, prompt, chat=chat, stream=stream,
                            max_tokens=max_tokens)
        assert got[:3] == want[:3], (prompt, chat, stream)
        resp = got[3]
        assert resp.headers.get("X-Speculative") == "draft-first"
        if not stream:
            draft = int(resp.headers["X-Draft-Tokens"])
            target = int(resp.headers["X-Target-Tokens"])
            assert got[2] is not None and draft + target == got[2]["completion_tokens"]
    drafted = await stack.metric("kvproxy_specfirst_tokens_total", alias=ALIAS, source="draft")
    from_target = await stack.metric("kvproxy_specfirst_tokens_total", alias=ALIAS,
                                     source="target")
    assert drafted + from_target > 0
    if agreement == 1.0:
        assert drafted > 3 * from_target  # a perfect draft writes most of the answer
    if agreement <= 0.2:
        assert from_target > drafted


async def test_token_id_prompts_and_finish_reasons(spec_stack: Factory) -> None:
    stack = await spec_stack(0.9, stop_len=(3, 6))
    ids = [1000 + i for i in range(20)]
    for max_tokens in (1, 2, 4, 30):
        body = {"model": TARGET, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        _, want = await stack.post(body, "/v1/completions")
        _, got = await stack.post(body | {"model": ALIAS}, "/v1/completions")
        w, g = orjson.loads(want)["choices"][0], orjson.loads(got)["choices"][0]
        assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"])


@pytest.mark.parametrize("extra", [
    {"n": 2}, {"logprobs": True, "top_logprobs": 2}, {"temperature": 0.7},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"stop": ["x"]}, {"presence_penalty": 0.5},
])
async def test_what_cannot_be_drafted_goes_to_the_target_unchanged(
        spec_stack: Factory, extra: dict[str, Any]) -> None:
    stack = await spec_stack(0.9)
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0, **extra}
    resp, raw = await stack.post(body)
    if "n" in extra or "tools" in extra:
        # the simulator refuses these itself: what matters is that the target was asked as is
        assert resp.headers.get("X-Speculative", "").startswith("target-only"), raw
        return
    assert resp.status == 200, raw
    assert resp.headers["X-Speculative"] == "target-only; reason=ineligible"
    assert "X-Draft-Tokens" not in resp.headers


async def test_a_failing_draft_pool_hands_over_to_the_target(spec_stack: Factory) -> None:
    stack = await spec_stack(0.9)
    prompt = "a long answer please"
    want = await _answer(stack, TARGET, prompt, chat=True, stream=False, max_tokens=40)
    await stack.faults(1, error_rate=1.0, error_status=500)
    got = await _answer(stack, ALIAS, prompt, chat=True, stream=True, max_tokens=40)
    assert got[:3] == want[:3]
    assert await stack.metric("kvproxy_specfirst_draft_failures_total", alias=ALIAS) >= 1


async def test_a_tenant_whose_drafts_are_rejected_falls_back(spec_stack: Factory) -> None:
    stack = await spec_stack(0.0, alias={"fallback_min_tokens": 8, "fallback_retry_s": 60.0})
    reasons = []
    for prompt in _prompts(8):
        body = {"model": ALIAS, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 20, "temperature": 0}
        resp, raw = await stack.post(body)
        assert resp.status == 200, raw
        reasons.append(resp.headers.get("X-Speculative"))
    assert reasons[0] == "draft-first"
    assert reasons[-1] == "target-only; reason=fallback"
    assert await stack.metric("kvproxy_specfirst_fallbacks_total", alias=ALIAS) == 1


async def test_a_client_leaving_aborts_the_engine_calls(spec_stack: Factory) -> None:
    stack = await spec_stack(1.0, stop_len=(4000, 4000), time_scale=1.0)
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 3000, "temperature": 0, "stream": True}
    resp = await stack.http.post(stack.server.url + "/v1/chat/completions", json=body)
    assert resp.status == 200
    await resp.content.readline()  # the first verified text has arrived
    resp.close()

    async def aborted() -> bool:
        engines = stack.cluster.engines
        return all(e.in_flight == 0 for e in engines) and any(e.aborted_ids for e in engines)

    async with asyncio.timeout(5):
        while not await aborted():  # noqa: ASYNC110 (polls the engines' counters)
            await asyncio.sleep(0.02)


async def _foreign_tokenizer() -> web.AppRunner:
    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"tokens": [7, 7, 7], "count": 3, "max_model_len": 100})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def test_pools_without_a_shared_tokenizer_refuse_to_start() -> None:
    cluster = await start_cluster([SimEngineConfig(model=TARGET, name="t0")], port=0)
    runner = await _foreign_tokenizer()
    try:
        port = runner.addresses[0][1]
        pools = (PoolConfig("target", TARGET, (EngineConfig("t0", cluster.urls[0]),)),
                 PoolConfig("draft", DRAFT, (EngineConfig("d0", f"http://127.0.0.1:{port}"),)))
        cfg = Config(pools=pools, aliases=(_alias(),))
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, port=0))
        server = ProxyServer(cfg)
        with pytest.raises(ConfigError, match="do not share a tokenizer"):
            await server.start()
        await server.stop()
    finally:
        await runner.cleanup()
        await cluster.close()


async def _engine_metric(stack: SpecStack, index: int, name: str) -> float:
    async with stack.http.get(stack.cluster.urls[index] + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


async def _drafted_equals_target(stack: SpecStack, prompts: list[str], *,
                                 target_first: bool) -> None:
    for i, prompt in enumerate(prompts):
        kw: dict[str, Any] = {"chat": i % 2 == 0, "stream": i % 3 == 0, "max_tokens": 40}
        if target_first:
            want = await _answer(stack, TARGET, prompt, **kw)
            got = await _answer(stack, ALIAS, prompt, **kw)
        else:
            got = await _answer(stack, ALIAS, prompt, **kw)
            want = await _answer(stack, TARGET, prompt, **kw)
        assert got[:3] == want[:3], prompt
        assert got[3].headers.get("X-Speculative") == "draft-first"


@pytest.mark.parametrize("scale_out", [True, False])
async def test_verification_reads_the_targets_prefix_cache(spec_stack: Factory,
                                                           scale_out: bool) -> None:
    """A round's verification reads what the last round left in the target's prefix cache (the
    token-in endpoint); a target without that endpoint is verified through prompt_logprobs,
    which vLLM computes without the cache. The answers are the target's either way."""
    stack = await spec_stack(0.9, alias={"fallback_rejection": 1.0}, scale_out=scale_out)
    await _drafted_equals_target(stack, _prompts(6), target_first=False)
    cached = await stack.metric("kvproxy_specfirst_verifications_total", alias=ALIAS,
                                mode="cached")
    recomputed = await stack.metric("kvproxy_specfirst_verifications_total", alias=ALIAS,
                                    mode="recomputed")
    if scale_out:
        assert cached > 6 and recomputed == 0
        assert await _engine_metric(stack, 0, "vllm:prefix_cache_hits_total") > 0
    else:
        assert cached == 0 and recomputed > 6


async def test_cached_positions_of_a_verification_are_not_trusted(spec_stack: Factory) -> None:
    """The target answered the same prompt first, so its cache holds the drafted positions of
    later rounds: their log-probabilities are never computed (the simulator, like vLLM, returns
    junk there) and the round is verified again without the cache."""
    stack = await spec_stack(0.9, alias={"fallback_rejection": 1.0})
    await _drafted_equals_target(stack, _prompts(6), target_first=True)
    assert await stack.metric("kvproxy_specfirst_verifications_total", alias=ALIAS,
                              mode="redone") > 0


async def test_verifications_of_concurrent_answers_share_target_steps(
        spec_stack: Factory) -> None:
    """Answers started 30 ms apart draft in step with each other but out of phase: each
    verification would reach the target alone and buy it a step of its own. With a window, a
    ready verification waits for the others still drafting, and they share steps."""
    stack = await spec_stack(1.0, alias={"verify_window_s": 0.3, "chunk": 8},
                             stop_len=(48, 48), time_scale=1.0)
    prompts = _prompts(6)
    wants = [await _answer(stack, TARGET, p, chat=True, stream=False, max_tokens=40)
             for p in prompts]
    async with stack.http.get(stack.cluster.urls[0] + "/admin/state") as resp:
        steps_before = (await resp.json())["steps"]

    async def one(i: int) -> Answer:
        await asyncio.sleep(0.03 * i)
        return await _answer(stack, ALIAS, prompts[i], chat=True, stream=False, max_tokens=40)

    async with asyncio.timeout(60):
        gots = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    assert [g[:3] for g in gots] == [w[:3] for w in wants]
    async with stack.http.get(stack.cluster.urls[0] + "/admin/state") as resp:
        steps = (await resp.json())["steps"] - steps_before
    verifications = sum([await stack.metric("kvproxy_specfirst_verifications_total",
                                            alias=ALIAS, mode=m) for m in ("cached", "redone")])
    assert verifications >= 1.5 * steps, (verifications, steps)
