"""A tenant's tokens per minute when the engine reports no usage: the proxy asks the engine for
usage on every stream, but an engine that still sends none is charged by estimate (the prompt
plus the bytes relayed), never for nothing.

The rogue engine's streams carry no usage event, whatever the request asks for.
"""

from __future__ import annotations

import openai
import pytest

from proxy.core.door_config import LimitsConfig

from .rogue import RogueEngine
from .shell import chat, proxy_for

LIMIT = 50  # tokens per minute


async def _stream(client: openai.AsyncOpenAI, content: str) -> None:
    stream = await client.chat.completions.create(**chat(content), stream=True)
    async for _ in stream:
        pass


async def test_a_stream_without_usage_is_charged_by_estimate(rogue: RogueEngine) -> None:
    rogue.behaviour.tokens = 40
    rogue.behaviour.token_bytes = 20  # about 6 KB of events: far past the limit by any estimate
    limits = LimitsConfig(enabled=True, tokens_per_min=LIMIT)
    async with proxy_for(rogue, limits=limits) as proxy:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
        try:
            await _stream(client, "hello")  # admitted: the bucket is full
            with pytest.raises(openai.RateLimitError) as caught:
                await _stream(client, "again")
        finally:
            await client.close()
    assert b'"code":"tokens_per_min"' in caught.value.response.content
    assert int(caught.value.response.headers["retry-after"]) >= 1
