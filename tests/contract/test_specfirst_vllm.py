"""Speculative-first answers on real vLLM (CPU): byte-identical to the target's own greedy answers.

Two tiny random-weight Llamas share one locally trained tokenizer (``scripts/make_tiny_models.py``):
the 4-layer target and the 2-layer draft. A third alias drafts with the target itself (it serves
a second name), the all-accepted case. For each of 50+ varied prompts, chat and completions,
streamed and not, the answer through each speculative-first alias must equal the target's own
answer: text, finish reason and usage.

The engines are started here (one target, one draft; about a minute each on CPU) unless
``KVPROXY_SPECFIRST_TARGET_URL`` and ``KVPROXY_SPECFIRST_DRAFT_URL`` name running ones (the target
serving ``tiny-target`` and ``tiny-target-self``, the draft ``tiny-draft``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from contract.conftest import STARTUP_TIMEOUT_S, free_port, require_vllm, tiny_models
from proxy.core.config import Config, ServerConfig, TelemetryConfig
from proxy.core.fleet_config import AliasConfig, EngineConfig, PoolConfig
from proxy.server.lifecycle import ProxyServer

BACKENDS = ("vllm",)
TARGET, SELF, DRAFT = "tiny-target", "tiny-target-self", "tiny-draft"
pytestmark = pytest.mark.timeout(STARTUP_TIMEOUT_S + 900)


def _start(python: str, model: str, names: list[str], core: str, log: Path,
           *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": core}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", *names, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
           "--enable-prefix-caching", "--seed", "0", *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited while starting (code {proc.returncode})")
        with contextlib.suppress(OSError), \
                urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(2)
    pytest.fail("vLLM did not start in time")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    given = (os.environ.get("KVPROXY_SPECFIRST_TARGET_URL"),
             os.environ.get("KVPROXY_SPECFIRST_DRAFT_URL"))
    if given[0] and given[1]:
        yield given[0], given[1]
        return
    python = require_vllm()
    models = tiny_models(python)
    logs = tmp_path_factory.mktemp("specfirst-vllm")
    # The target serves cache-reading verification (the token-in endpoint, cached-token counts).
    procs = [_start(python, models["target"], [TARGET, SELF], "0", logs / "target.log",
                    "--enable-scale-out", "--enable-prompt-tokens-details"),
             _start(python, models["draft"], [DRAFT], "1", logs / "draft.log")]
    try:
        for proc, url in procs:
            _wait(url, proc)
        yield procs[0][1], procs[1][1]
    finally:
        for proc, _ in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _config(target_url: str, draft_url: str) -> Config:
    pools = (PoolConfig("target", TARGET, (EngineConfig("t0", target_url),)),
             PoolConfig("self", SELF, (EngineConfig("t0-self", target_url),)),
             PoolConfig("draft", DRAFT, (EngineConfig("d0", draft_url),)))
    aliases = tuple(AliasConfig(name, mode="speculative_first", draft=pool, target="target",
                                chunk=6, fallback_rejection=1.0)
                    for name, pool in (("sf", "draft"), ("sf-self", "self")))
    # vLLM-CPU on a busy machine can take over 150 ms to render /metrics: scrape less eagerly,
    # so that a slow scrape does not shed the draft leg (what is checked here is the answers).
    telemetry = TelemetryConfig(interval_s=1.0, timeout_s=0.9, stale_after_s=5.0)
    return Config(server=ServerConfig(host="127.0.0.1", port=0), pools=pools, aliases=aliases,
                  telemetry=telemetry)


SUBJECTS = ("the cache", "a queue of requests", "prefix blocks", "tenants", "draft models",
            "naïve café ünïcödé", "東京 and 大阪", "numbers 3.14159 and 2718", "emoji 🙂🚀")


def _prompt(i: int) -> str:
    return (f"Question {i}: what about {SUBJECTS[i % len(SUBJECTS)]}? "
            + "Explain step by step. " * (i % 5))


async def _ask(http: aiohttp.ClientSession, url: str, model: str, i: int
               ) -> tuple[tuple[str, str, dict[str, int]], dict[str, str]]:
    chat, stream = i % 2 == 0, i % 3 != 0
    body: dict[str, Any] = {"model": model, "max_tokens": 6 + i % 11, "temperature": 0,
                            "stream": stream}
    if chat:
        body["messages"] = [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": _prompt(i)}]
    else:
        body["prompt"] = _prompt(i)
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with http.post(url + path, json=body) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        headers = dict(resp.headers)
    return (_streamed(raw, chat) if stream else _whole(raw, chat)), headers


def _whole(raw: bytes, chat: bool) -> tuple[str, str, dict[str, int]]:
    data = orjson.loads(raw)
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return text, choice["finish_reason"], _counts(data["usage"])


def _streamed(raw: bytes, chat: bool) -> tuple[str, str, dict[str, int]]:
    text, finish, usage = [], "", {}
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = orjson.loads(line[6:])
        usage = _counts(event["usage"]) if event.get("usage") else usage
        for choice in event.get("choices", []):
            text.append((choice.get("delta", {}).get("content") if chat else choice["text"])
                        or "")
            finish = choice.get("finish_reason") or finish
    return "".join(text), finish, usage


def _counts(usage: dict[str, Any]) -> dict[str, int]:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


async def test_speculative_first_answers_equal_the_target_alone(
        engines: tuple[str, str]) -> None:
    server = ProxyServer(_config(*engines))
    await server.start()
    drafted = {"sf": 0, "sf-self": 0}
    total = {"sf": 0, "sf-self": 0}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            for i in range(52):
                want, _ = await _ask(http, server.url, TARGET, i)
                for alias in ("sf", "sf-self"):
                    got, headers = await _ask(http, server.url, alias, i)
                    assert got == want, (alias, i)
                    assert headers.get("X-Speculative") == "draft-first"
                    if "X-Draft-Tokens" in headers:
                        drafted[alias] += int(headers["X-Draft-Tokens"])
                        total[alias] += int(headers["X-Draft-Tokens"]) + \
                            int(headers["X-Target-Tokens"])
            modes = await _verifications(http, server.url)
    finally:
        await server.stop()
    # The target as its own draft: the target rejects (almost) nothing, so most tokens are
    # drafted (the rest: the one token each round adds after a fully kept chunk).
    assert drafted["sf-self"] >= 0.6 * total["sf-self"]
    assert drafted["sf"] > 0
    # Rounds verified reading the target's prefix cache, and rounds whose drafted positions the
    # cache already held (the target answered the same prompt first), verified again without it.
    assert modes.get("cached", 0) > 0 and modes.get("redone", 0) > 0, modes


async def _verifications(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvproxy_specfirst_verifications_total{"):
            mode = line.split('mode="', 1)[1].split('"', 1)[0]
            out[mode] = out.get(mode, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def test_the_token_in_endpoint_keys_its_prefix_cache_by_cache_salt(
        engines: tuple[str, str]) -> None:
    # What speculative-first verification relies on for tenant isolation (``verify_cached``
    # sends the tenant's salt), and what the simulator's endpoint does the same way.
    target, _ = engines
    seed = int(time.time() * 1000) % 97
    ids = [5 + (seed + 7 * i) % 90 for i in range(300)]

    async def cached(http: aiohttp.ClientSession, **extra: object) -> int:
        body = {"model": TARGET, "token_ids": ids, **extra,
                "sampling_params": {"max_tokens": 1, "temperature": 0,
                                    "skip_reading_prefix_cache": False}}
        async with http.post(target + "/inference/v1/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
            return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        assert await cached(http, cache_salt=f"tenant-a-{seed}") == 0
        assert await cached(http, cache_salt=f"tenant-b-{seed}") == 0
        assert await cached(http, cache_salt=f"tenant-a-{seed}") > 0
