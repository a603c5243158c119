"""Precise routing against real vLLM on CPU: the proxy (in this process, so that its index can be
read) tokenizes with the tiny model's own tokenizer files and listens to engine ``a``'s KV events.

- The proxy's token ids of a chat request are vLLM's (``/tokenize``), chat template included.
- After a request, the proxy's index for ``a`` holds exactly the blocks vLLM reported (as an
  independent subscriber records them), and a second request sharing the prefix is routed to
  ``a``: the first requests went to ``a`` directly, so only its events can have told the proxy.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio
from sim.kv_subscriber import Subscriber, replay, reported_blocks

from contract.client import Backend, post_json
from proxy.core.config import Config, RoutingConfig, ServerConfig, TelemetryConfig
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.kv_config import EngineEvents
from proxy.fleet.tokenizer import load_tokenizer
from proxy.server.keys import SHELL
from proxy.server.lifecycle import ProxyServer

BACKENDS = ("vllm",)  # the simulator's path is tests/integration/test_precise_routing.py


@pytest_asyncio.fixture(loop_scope="session")
async def proxy(backend: Backend) -> AsyncIterator[tuple[ProxyServer, Subscriber]]:
    assert backend.kv_events is not None and backend.tokenizer is not None
    events = EngineEvents(backend.kv_events.connect_at, backend.kv_events.replay_at)
    engines = (EngineConfig("a", backend.a.url, backend.a.metrics_url, kv_events=events),
               EngineConfig("b", backend.b.url, backend.b.metrics_url))
    cfg = Config(server=ServerConfig(host="127.0.0.1", port=0),
                 telemetry=TelemetryConfig(interval_s=0.5, timeout_s=0.4, stale_after_s=5.0),
                 routing=RoutingConfig(block_chars=64),
                 pools=(PoolConfig("target", backend.model, engines, isolation="none",
                                   tokenizer=backend.tokenizer),))
    server = ProxyServer(cfg)
    await server.start()
    sub = Subscriber(connect=backend.kv_events.connect_at)
    try:
        yield server, sub
    finally:
        sub.close()
        await server.stop()


def _chat(model: str, prefix: str, question: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": prefix},
                         {"role": "user", "content": question}]}


async def _until(check: Any, what: str, timeout_s: float = 60.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():  # noqa: ASYNC110 (polls other processes)
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_the_proxy_tokenizes_chat_as_vllm_does(backend: Backend) -> None:
    assert backend.tokenizer is not None
    tok = load_tokenizer(backend.tokenizer, "tokenizer")
    body = _chat(backend.model, "the router learns what each engine holds", "which one?")
    status, got = await post_json(backend.a.url + "/tokenize",
                                  {"model": backend.model, "messages": body["messages"]})
    assert status == 200, got
    assert tok.request_ids(True, body) == got["tokens"]
    status, got = await post_json(backend.a.url + "/tokenize",
                                  {"model": backend.model, "prompt": "the cache holds a block"})
    assert tok.request_ids(False, {"prompt": "the cache holds a block"}) == got["tokens"]


# A string-format template that renders what agent traffic carries: the tools, a tool call's
# arguments (which vLLM hands over as an object), a null content, and a template variable.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %} call {{ c.function.name }}"
    "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if not enable_thinking %} no thinking"
    "{% endif %}{% endif %}")


async def test_the_proxy_renders_tool_conversations_and_template_variables_as_vllm_does(
        backend: Backend, tmp_path: Path) -> None:
    assert backend.tokenizer is not None
    shutil.copytree(backend.tokenizer, tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tok = load_tokenizer(str(tmp_path / "tok"), "tokenizer")
    call = {"id": "c1", "type": "function",
            "function": {"name": "route", "arguments": '{"engine": "a", "blocks": 3}'}}
    messages = [{"role": "user", "content": "which engine holds the prefix?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "the engine a", "tool_call_id": "c1"}]
    tools = [{"type": "function", "function": {
        "name": "route", "description": "find the engine",
        "parameters": {"type": "object", "properties": {"engine": {"type": "string"}}}}}]
    bodies = [
        {"messages": messages, "tools": tools},
        {"messages": messages, "chat_template_kwargs": {"enable_thinking": True}},
        {"messages": [*messages, {"role": "assistant", "content": "the cache "}],
         "add_generation_prompt": False, "continue_final_message": True},
    ]
    for body in bodies:
        status, got = await post_json(backend.a.url + "/tokenize", {
            "model": backend.model, "chat_template": TOOL_TEMPLATE, **body})
        assert status == 200, got
        assert tok.request_ids(True, body) == got["tokens"], body


async def test_the_index_is_what_vllm_reported_and_a_shared_prefix_is_routed_there(
        backend: Backend, proxy: tuple[ProxyServer, Subscriber]) -> None:
    server, sub = proxy
    assert backend.kv_events is not None
    precise = server.app[SHELL].precise
    assert precise is not None
    listener = precise.listeners["a"]
    await _until(lambda: asyncio.sleep(0, listener.precise), "engine a in sync")

    seen: dict[str, Any] = {}

    async def matches() -> bool:
        while await sub.receive(0.05) is not None:
            pass
        # Batches sent before this subscriber connected come from the replay socket.
        for batch in await replay(backend.kv_events.replay_at, 0):  # type: ignore[union-attr]
            sub.batches.setdefault(batch.seq, batch)
        reported = reported_blocks(sub.events())
        held = listener.index.keys()
        # What differs, for the failure message: sizes, both differences, the listener's view.
        seen.update(reported=len(reported), proxy=len(held), only_reported=len(reported - held),
                    only_proxy=len(held - reported), row=listener.row(),
                    batches=len(sub.batches), last=max(sub.batches, default=None))
        return bool(reported) and held == reported

    prefixes = [f"{uuid.uuid4().hex} " + "the proxy keeps an exact index of engine blocks. " * 8
                for _ in range(3)]
    async with aiohttp.ClientSession() as http:
        for prefix in prefixes:  # straight to engine a
            async with http.post(backend.a.url + "/v1/chat/completions",
                                 json=_chat(backend.model, prefix, "first")) as resp:
                assert resp.status == 200, await resp.text()
        try:
            await _until(matches, "the proxy's index to equal what vLLM reported")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {seen}") from None
        served = []
        for prefix in prefixes:
            async with http.post(server.url + "/v1/chat/completions",
                                 json=_chat(backend.model, prefix, "second, other")) as resp:
                assert resp.status == 200, await resp.text()
                served.append(resp.headers["X-Engine"])
    assert served == ["a"] * len(prefixes)
    await _until(matches, "the index to equal vLLM's report after proxied requests")
