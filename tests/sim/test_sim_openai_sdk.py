"""The official ``openai`` SDK streams from the simulator, chat and completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from .conftest import Start


@pytest.fixture
async def client(start: Start) -> AsyncIterator[openai.AsyncOpenAI]:
    cluster = await start()
    sdk = openai.AsyncOpenAI(base_url=cluster.urls[0] + "/v1", api_key="unused", max_retries=0)
    yield sdk
    await sdk.close()


async def test_sdk_streams_chat(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "Say something"}],
        max_tokens=7, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, reasons, usage = "", [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    assert len(text) == 7 * 4
    assert reasons[-1] == "length"
    assert usage is not None
    assert usage.completion_tokens == 7


async def test_sdk_streams_completions(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model="sim-model", prompt="Once upon a time", max_tokens=5, stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [choice.text async for chunk in stream for choice in chunk.choices]
    assert len("".join(pieces)) == 5 * 4


async def test_sdk_non_streaming_and_models(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0,
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 3
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim-model"]
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="sim-model", prompt="x" * 40000, max_tokens=3)
