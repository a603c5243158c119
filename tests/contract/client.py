"""Small HTTP helpers for the contract tests (aiohttp, real sockets)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from engine_sidecar.vllm.metrics import Sample, parse_samples

TIMEOUT = aiohttp.ClientTimeout(total=120)
MODEL = "tiny-target"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
NUM_SPEC_TOKENS = 3


@dataclass(frozen=True)
class Engine:
    name: str
    url: str  # the OpenAI API: the proxy's data path
    metrics_url: str  # what the proxy scrapes: the sidecar's /metrics for vLLM
    sidecar_url: str | None = None
    engine_metrics_url: str | None = None  # vLLM's own /metrics


@dataclass(frozen=True)
class KvEventsAt:
    """Where engine ``a`` publishes its KV events: it binds a wildcard endpoint (vLLM's default
    form), subscribers connect to ``connect_at``, and it answers replay requests at ``replay_at``.
    Several subscribers (a test's own, a proxy's) can listen at once."""

    connect_at: str
    replay_at: str


@dataclass
class Backend:
    kind: str
    a: Engine
    b: Engine
    model: str = MODEL
    block_size: int = BLOCK_SIZE
    max_model_len: int = MAX_MODEL_LEN
    num_speculative_tokens: int = NUM_SPEC_TOKENS
    timings: dict[str, float] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    kv_events: KvEventsAt | None = None
    # The model's tokenizer (a directory with tokenizer.json and its chat template), if known.
    tokenizer: str | None = None


@dataclass
class Streamed:
    status: int
    content_type: str
    events: list[str]  # the payload of every `data:` line, in order

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


async def post_json(url: str, body: dict[str, Any] | bytes) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        kwargs: dict[str, Any] = ({"data": body, "headers": {"Content-Type": "application/json"}}
                                  if isinstance(body, bytes) else {"json": body})
        async with s.post(url, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None)


async def stream(url: str, body: dict[str, Any]) -> Streamed:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(url, json=body) as resp:
        raw = (await resp.read()).decode()
        events = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
        return Streamed(resp.status, resp.headers.get("Content-Type", ""), events)


async def scrape(url: str) -> list[Sample]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(url) as resp:
        assert resp.status == 200, f"{url} answered {resp.status}"
        return list(parse_samples(await resp.text()))


async def scrape_text(url: str) -> str:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(url) as resp:
        return await resp.text()


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of ``name`` over the samples matching ``labels`` (0 when absent)."""
    return sum(s.value for s in samples if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


async def metric(url: str, name: str, **labels: str) -> float:
    return value(await scrape(url), name, **labels)


async def poll(check: Callable[[], Any], timeout_s: float) -> bool:
    """Poll the async ``check`` until it returns truthy (True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.1)
    return False


async def wait_until(check: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> None:
    """Poll the async ``check`` until it returns truthy; fail with ``what`` after the timeout."""
    if not await poll(check, timeout_s):
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


async def settled_metric(url: str, name: str, quiet_s: float = 1.0,
                         timeout_s: float = 30.0) -> float:
    """The metric's value once it has stayed unchanged for ``quiet_s``: a request the engine keeps
    running moves its token counter on, so a settled value is one no request is still adding to."""
    deadline = time.monotonic() + timeout_s
    last = await metric(url, name)
    while time.monotonic() < deadline:
        await asyncio.sleep(quiet_s)
        now = await metric(url, name)
        if now == last:
            return now
        last = now
    raise AssertionError(f"{name} still moving after {timeout_s:.0f} s")
