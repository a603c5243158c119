"""The rogue engine answers as a healthy engine until told otherwise (guards the tier's helper)."""

from __future__ import annotations

import aiohttp

from .rogue import RogueEngine


async def test_rogue_engine_serves_metrics_and_streams(rogue: RogueEngine) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(rogue.url + "/metrics") as resp:
            assert resp.status == 200
            assert "vllm:kv_cache_usage_perc" in await resp.text()
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(rogue.url + "/v1/chat/completions", json=body) as resp:
            text = await resp.text()
    assert text.count("data: ") == rogue.behaviour.tokens + 1
    assert text.endswith("data: [DONE]\n\n")
    assert [s.path for s in rogue.seen] == ["/metrics", "/v1/chat/completions"]
