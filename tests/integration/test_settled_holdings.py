"""The first byte settles a prompt where it was answered: the cost model's abandoned charge
counts only holdings an engine is known to have computed (``proxy.core.holdings``)."""

from __future__ import annotations

from proxy.core.costmodel import ExpectedTTFT
from proxy.server.keys import SHELL

from .stack import Stack, chat_body

PROMPT = "a conversation's history, long enough for a few blocks " * 40


def _policy(stack: Stack) -> ExpectedTTFT:
    policy = stack.server.app[SHELL].policies["target"]
    assert isinstance(policy, ExpectedTTFT)
    return policy


async def test_an_answered_request_settles_its_prompt_on_the_engine_that_answered(
        stack: Stack) -> None:
    policy = _policy(stack)
    async with await stack.post("/v1/chat/completions", chat_body(PROMPT, stream=True)) as resp:
        assert resp.status == 200
        engine = resp.headers["X-Engine"]
        await resp.read()
    other = next(n for n in stack.names if n != engine)
    assert policy.holdings.settled.size(engine) > 0
    assert policy.holdings.settled.size(other) == 0
    assert not policy._unconfirmed  # nothing left waiting for a first byte


async def test_a_failed_engine_settles_nothing_and_the_retry_engine_settles_it(
        stack: Stack) -> None:
    policy = _policy(stack)
    for name in stack.names:
        await stack.faults(name, error_rate=1.0, error_status=500)
    async with await stack.post("/v1/chat/completions", chat_body(PROMPT)) as resp:
        assert resp.status >= 500
        await resp.read()
    assert all(policy.holdings.settled.size(n) == 0 for n in stack.names)
    first = stack.names[0]
    await stack.clear_faults(first)
    async with await stack.post("/v1/chat/completions", chat_body(PROMPT)) as resp:
        assert resp.status == 200
        assert resp.headers["X-Engine"] == first
        await resp.read()
    assert policy.holdings.settled.size(first) > 0
    assert policy.holdings.settled.size(stack.names[1]) == 0


async def test_a_prompt_an_engine_refuses_is_not_drawn_back_to_it(stack: Stack) -> None:
    # An engine's 4xx computed nothing: the record the pick made there is taken back, and the
    # refused prompt's size does not enter the pool's mean prompt (the expected-wait gauge).
    policy = _policy(stack)
    too_long = chat_body(PROMPT * 40, max_tokens=16)
    async with await stack.post("/v1/chat/completions", too_long) as resp:
        assert resp.status == 400, await resp.text()
        engine = resp.headers["X-Engine"]
    assert policy.holdings.index.size(engine) == 0
    assert policy.mean_prompt == 0.0 and not policy._unconfirmed
    async with await stack.post("/v1/chat/completions", chat_body(PROMPT)) as resp:
        assert resp.status == 200
        await resp.read()
    assert policy.mean_prompt > 0.0
