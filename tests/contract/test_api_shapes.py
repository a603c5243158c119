"""What the proxy relays byte for byte must look the same on the simulator and on vLLM:
SSE chunk shapes, ``[DONE]``, the usage chunk, and plain-HTTP errors for bad requests."""

from __future__ import annotations

import aiohttp
import pytest

from contract.client import Backend, post_json, stream

CHAT = [{"role": "user", "content": "hello world, tell me about the cache"}]


def chat_body(backend: Backend, **extra: object) -> dict[str, object]:
    return {"model": backend.model, "messages": CHAT, "max_tokens": 12, "temperature": 0, **extra}


async def test_chat_stream_chunks_and_done(backend: Backend) -> None:
    s = await stream(backend.a.url + "/v1/chat/completions", chat_body(backend, stream=True))
    assert s.status == 200
    assert s.content_type.startswith("text/event-stream")
    assert s.events[-1] == "[DONE]" and s.events.count("[DONE]") == 1
    chunks = s.chunks
    assert len({c["id"] for c in chunks}) == 1
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["model"] == backend.model
        assert isinstance(c["created"], int)
        assert len(c["choices"]) == 1 and c["choices"][0]["index"] == 0
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "usage" not in chunks[-1] or chunks[-1]["usage"] is None


async def test_chat_stream_usage_chunk_comes_last(backend: Backend) -> None:
    body = chat_body(backend, stream=True, stream_options={"include_usage": True})
    s = await stream(backend.a.url + "/v1/chat/completions", body)
    *content, usage_chunk = s.chunks
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] == 12  # max_tokens reached, no early EOS at temperature 0
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(not c.get("usage") for c in content)


async def test_completion_stream_chunks(backend: Backend) -> None:
    body = {"model": backend.model, "prompt": "Once upon a time", "max_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}}
    s = await stream(backend.b.url + "/v1/completions", body)
    assert s.status == 200 and s.events[-1] == "[DONE]"
    *content, usage_chunk = s.chunks
    for c in content:
        assert c["object"] == "text_completion"
        assert isinstance(c["choices"][0]["text"], str)
    assert usage_chunk["usage"]["completion_tokens"] == 8


async def test_non_streamed_chat_shape(backend: Backend) -> None:
    status, body = await post_json(backend.a.url + "/v1/chat/completions", chat_body(backend))
    assert status == 200
    assert body["object"] == "chat.completion" and body["model"] == backend.model
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 12


def assert_openai_error(body: dict[str, object]) -> None:
    err = body["error"]
    assert isinstance(err, dict)
    assert {"message", "type", "param", "code"} <= set(err)
    assert isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize("stream_flag", [False, True], ids=["json", "stream"])
async def test_unknown_model_is_404_before_any_stream(backend: Backend, stream_flag: bool) -> None:
    body = {"model": "no-such-model", "messages": CHAT, "max_tokens": 4, "stream": stream_flag}
    status, err = await post_json(backend.a.url + "/v1/chat/completions", body)
    assert status == 404
    assert_openai_error(err)


async def test_malformed_json_is_400(backend: Backend) -> None:
    status, err = await post_json(backend.a.url + "/v1/chat/completions", b'{"model": "x",')
    assert status == 400
    assert_openai_error(err)


async def test_wrong_field_type_is_400(backend: Backend) -> None:
    body = {"model": backend.model, "messages": "not a list", "max_tokens": 4}
    status, err = await post_json(backend.a.url + "/v1/chat/completions", body)
    assert status == 400
    assert_openai_error(err)


@pytest.mark.parametrize("stream_flag", [False, True], ids=["json", "stream"])
async def test_prompt_longer_than_context_is_400(backend: Backend, stream_flag: bool) -> None:
    # About 3000 tokens for a 2048-token context, but under vLLM's character pre-check.
    prompt = "hello world " * 1500
    body = {"model": backend.model, "prompt": prompt, "max_tokens": 4, "stream": stream_flag}
    status, err = await post_json(backend.b.url + "/v1/completions", body)
    assert status == 400
    assert_openai_error(err)


async def test_max_tokens_beyond_context_is_400(backend: Backend) -> None:
    body = {"model": backend.model, "prompt": "hi", "max_tokens": backend.max_model_len + 100}
    status, err = await post_json(backend.b.url + "/v1/completions", body)
    assert status == 400
    assert_openai_error(err)


async def test_models_lists_the_served_name(backend: Backend) -> None:
    async with aiohttp.ClientSession() as s, s.get(backend.a.url + "/v1/models") as resp:
        body = await resp.json()
    assert resp.status == 200
    assert backend.model in [m["id"] for m in body["data"]]
