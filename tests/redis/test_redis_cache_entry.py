"""Answer assembly from SSE, entry encoding and replay (pure)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.cache_entry import (
    CachedResponse,
    EntryError,
    decode_entry,
    replay_sse,
    streamable,
)
from proxy.core.recording import StreamAssembler, complete_json

HEAD = {"id": "chatcmpl-1", "created": 1700000000, "model": "m"}


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**HEAD, "object": "chat.completion.chunk", "choices": [choice]}


def sse(*objs: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objs)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chat_stream(pieces: list[str], finish: str = "stop", usage: bool = True) -> bytes:
    chunks = [chat_chunk({"role": "assistant", "content": ""})]
    chunks += [chat_chunk({"content": p}) for p in pieces]
    chunks.append(chat_chunk({"content": ""}, finish))
    if usage:
        totals = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        chunks.append({**HEAD, "object": "chat.completion.chunk", "choices": [], "usage": totals})
    return sse(*chunks)


def assemble(data: bytes, *, chat: bool = True, split: int = 7) -> dict[str, Any] | None:
    asm = StreamAssembler(chat=chat, max_bytes=1 << 20)
    for i in range(0, len(data), split):
        asm.feed(data[i : i + split])
    return asm.result()


def content_of_stream(data: bytes) -> str:
    text = ""
    for line in data.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for choice in orjson.loads(line[6:])["choices"]:
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return text


@settings(deadline=None)
@given(st.lists(st.text(max_size=8), max_size=12), st.integers(1, 50))
def test_assembled_answer_equals_the_stream(pieces: list[str], split: int) -> None:
    result = assemble(chat_stream(pieces), split=split)
    assert result is not None
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"] == {"role": "assistant", "content": "".join(pieces)}
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"]["total_tokens"] == 7


def test_crlf_and_comments_are_understood() -> None:
    data = b": keep-alive\r\n\r\n" + chat_stream(["a", "b"]).replace(b"\n", b"\r\n")
    result = assemble(data)
    assert result is not None and result["choices"][0]["message"]["content"] == "ab"


@pytest.mark.parametrize("split", [1, 3, 7, 1 << 20])
def test_other_event_shapes_are_understood(split: int) -> None:
    """Fields besides data, a payload over two data lines, no space after the colon, extra blank
    lines, a CR at the end of one read and its LF at the start of the next."""
    first = orjson.dumps(chat_chunk({"role": "assistant", "content": "a"}))
    cut = len(first) // 2
    data = (b"id: 1\nevent: message\ndata: " + first[:cut] + b"\ndata: " + first[cut:]
            + b"\n\n\n\ndata:" + orjson.dumps(chat_chunk({"content": "b"}, "stop")) + b"\r\n\r\n"
            + b"data:[DONE]\n\n")
    result = assemble(data, split=split)
    assert result is not None and result["choices"][0]["message"]["content"] == "ab"


@pytest.mark.parametrize(
    "data",
    [
        chat_stream(["a", "b"])[: -len(b"data: [DONE]\n\n")],  # cut before [DONE]
        sse(chat_chunk({"content": "a"})),  # no finish_reason
        sse(chat_chunk({"content": "a"}), chat_chunk({}, "abort")),
        sse(chat_chunk({"content": "a"}), {"error": {"message": "boom"}}),
        sse(chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}, "stop")),
        b"data: {not json\n\ndata: [DONE]\n\n",
        chat_stream(["a"]) + b"data: " + orjson.dumps(chat_chunk({"content": "late"})) + b"\n\n",
        chat_stream(["a"]) + b'data: {"partial',
    ],
)
def test_incomplete_or_unmergeable_streams_are_not_answers(data: bytes) -> None:
    assert assemble(data) is None


def token_ids_stream() -> bytes:
    """vLLM's stream for ``return_token_ids``: the prompt's ids on the first event, each
    token's on its choice."""
    first = {**chat_chunk({"role": "assistant", "content": ""}), "prompt_token_ids": [1, 2, 3]}
    token = chat_chunk({"content": "a"})
    token["choices"][0]["token_ids"] = [7]
    return sse(first, token, chat_chunk({}, "stop"))


@pytest.mark.parametrize("where", ["event", "choice"])
def test_a_stream_with_a_field_the_answer_would_drop_is_not_stored(where: str) -> None:
    data = token_ids_stream()
    if where == "event":  # only the prompt's ids
        data = data.replace(b',"token_ids":[7]', b',"token_ids":null')
    else:  # only the token's ids
        data = data.replace(b',"prompt_token_ids":[1,2,3]', b"")
    assert assemble(data) is None


def test_fields_vllm_writes_as_null_do_not_stop_a_stream_being_stored() -> None:
    data = token_ids_stream().replace(b"[1,2,3]", b"null").replace(b"[7]", b"null")
    result = assemble(data)
    assert result is not None and result["choices"][0]["message"]["content"] == "a"


def test_an_answer_with_a_field_no_stream_carries_is_not_streamable() -> None:
    choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "logprobs": None,
              "finish_reason": "stop", "stop_reason": None, "token_ids": None}  # fmt: skip
    plain = {**HEAD, "object": "chat.completion", "choices": [choice], "usage": None,
             "service_tier": None, "prompt_token_ids": None,
             "system_fingerprint": "fp"}  # fmt: skip
    assert streamable(plain)
    assert not streamable({**plain, "prompt_token_ids": [1, 2]})
    assert not streamable({**plain, "service_tier": "default"})
    assert not streamable({**plain, "choices": [{**choice, "token_ids": [5]}]})


def test_size_bound_gives_up() -> None:
    asm = StreamAssembler(chat=True, max_bytes=100)
    asm.feed(chat_stream(["x" * 200]))
    assert asm.result() is None and not asm.storable


def test_text_completion_stream() -> None:
    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**HEAD, "object": "text_completion", "choices": [choice]}

    result = assemble(sse(chunk("Hel"), chunk("lo"), chunk("", "length")), chat=False)
    assert result is not None
    assert result["choices"][0]["text"] == "Hello"
    assert result["choices"][0]["finish_reason"] == "length"


def test_complete_json() -> None:
    ok = {**HEAD, "object": "chat.completion",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                       "finish_reason": "stop"}]}  # fmt: skip
    assert complete_json(orjson.dumps(ok)) == ok
    unfinished = orjson.loads(orjson.dumps(ok))
    unfinished["choices"][0]["finish_reason"] = None
    assert complete_json(orjson.dumps(unfinished)) is None
    assert complete_json(b'{"error": {"message": "x"}}') is None
    assert complete_json(b"garbage") is None


@settings(deadline=None)
@given(st.text(max_size=40), st.booleans(), st.booleans())
def test_replay_round_trips(content: str, chat: bool, include_usage: bool) -> None:
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content},
                                  "logprobs": None, "finish_reason": "stop"}  # fmt: skip
    else:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": "stop"}
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    response = {**HEAD, "object": "chat.completion" if chat else "text_completion",
                "choices": [choice], "usage": usage}  # fmt: skip
    entry = CachedResponse("t", "m", chat, response)
    replay = replay_sse(entry, include_usage=include_usage)
    assert replay.endswith(b"data: [DONE]\n\n")
    assert content_of_stream(replay) == content
    again = assemble(replay, chat=chat)
    assert again is not None
    assert again["choices"][0]["finish_reason"] == "stop"
    assert (again["usage"] == usage) is include_usage


def test_entry_encoding_binds_tenant_and_model() -> None:
    response = {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]}
    raw = CachedResponse("acme", "m", False, response).encode()
    assert decode_entry(raw, tenant="acme", model="m").response == response
    for tenant, model in (("other", "m"), ("acme", "n")):
        with pytest.raises(EntryError):
            decode_entry(raw, tenant=tenant, model=model)
    for garbage in (b"", b"\x00\xff", b"[]", b'{"v": 99}', b'{"v":1,"t":"acme","m":"m","r":{}}'):
        with pytest.raises(EntryError):
            decode_entry(garbage, tenant="acme", model="m")


@pytest.mark.parametrize("bad", [
    {"message": "hi"}, {"message": 3}, {"message": ["x"]}, {"message": {"role": 1}},
    {"message": {"content": {"x": 1}}}, {"message": {"tool_calls": ["x", 3]}},
    {"message": {"tool_calls": "x"}}, {"index": "0"}, {"index": True},
])
def test_a_stored_chat_answer_of_the_wrong_shape_does_not_decode(bad: dict[str, Any]) -> None:
    # Whatever the store holds under a tenant's key, only an answer a replay can render decodes:
    # the rest is a miss, refreshed by the engine's answer, never a broken stream.
    choice = {"index": 0, "finish_reason": "stop",
              "message": {"role": "assistant", "content": "x"}} | bad
    ok = {"choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": "x"}}]}
    assert decode_entry(CachedResponse("acme", "m", True, ok).encode(), tenant="acme", model="m")
    raw = CachedResponse("acme", "m", True, {"choices": [choice]}).encode()
    with pytest.raises(EntryError, match="wrong shape"):
        decode_entry(raw, tenant="acme", model="m")


@pytest.mark.parametrize("bad", [
    {"usage": "lots"}, {"usage": {"total_tokens": "2"}}, {"id": {"x": 1}}, {"created": "now"},
    {"model": 3}, {"object": None},
])
def test_a_stored_answer_with_a_head_or_usage_of_the_wrong_type_does_not_decode(
    bad: dict[str, Any],
) -> None:
    response = {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]} | bad
    raw = CachedResponse("acme", "m", False, response).encode()
    with pytest.raises(EntryError, match="wrong shape"):
        decode_entry(raw, tenant="acme", model="m")
    raw = CachedResponse("acme", "m", False, {"choices": [{"text": 7, "finish_reason": "stop"}]})
    with pytest.raises(EntryError, match="wrong shape"):
        decode_entry(raw.encode(), tenant="acme", model="m")


def test_a_long_stream_fed_at_once_assembles_every_choice() -> None:
    # The relay hands the whole stream over in one piece at its end: thousands of events.
    def chunk(index: int, text: str, finish: str | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": {"content": text}, "logprobs": None,
                  "finish_reason": finish, "stop_reason": None if finish else 7}
        return {**HEAD, "object": "chat.completion.chunk", "choices": [choice]}

    parts = [chunk(i % 2, f"{i} ") for i in range(4000)]
    parts += [chunk(0, "", "stop"), chunk(1, "", "length")]
    asm = StreamAssembler(chat=True, max_bytes=1 << 22)
    asm.feed(sse(*parts))
    result = asm.result()
    assert result is not None
    even, odd = result["choices"]
    assert even["message"]["content"] == "".join(f"{i} " for i in range(0, 4000, 2))
    assert odd["message"]["content"] == "".join(f"{i} " for i in range(1, 4000, 2))
    assert (even["finish_reason"], odd["finish_reason"]) == ("stop", "length")
    assert even["stop_reason"] is None and even["message"]["role"] == "assistant"


def _token_chunks() -> list[dict[str, Any]]:
    """Events near the usual token's shape, each differing in one way the fast path must see."""
    first = chat_chunk({"role": "assistant", "content": ""})
    extra = chat_chunk({"content": "x", "reasoning_content": "r"})
    logprobs = chat_chunk({"content": "x"})
    logprobs["choices"][0]["logprobs"] = {"content": []}
    stop_reason = chat_chunk({"content": "x"})
    stop_reason["choices"][0]["stop_reason"] = None
    float_index = chat_chunk({"content": "x"})
    float_index["choices"][0]["index"] = 0.0
    second = chat_chunk({"content": "y"})
    second["choices"][0]["index"] = 1
    no_index = chat_chunk({"content": "x"})
    del no_index["choices"][0]["index"]
    no_index["choices"][0]["extra"] = 1
    return [first, extra, logprobs, stop_reason, float_index, second, no_index]


@pytest.mark.parametrize("variant", range(1, len(_token_chunks())))
def test_the_usual_events_fast_path_agrees_with_the_line_by_line_path(variant: int) -> None:
    """A stream of one-line events is cut and merged on a fast path; a comment line sends the
    same events through the general path. Both give the same answer (or none)."""
    chunks = _token_chunks()
    last = chat_chunk({"content": ""}, "stop")
    data = sse(chunks[0], chat_chunk({"content": "a"}), chunks[variant], last)
    fast = assemble(data, split=1 << 20)
    slow = assemble(b": keep-alive\n\n" + data, split=1 << 20)
    assert fast == slow
    # Not stored: per-token logprobs, a float index, a second choice that never finished, a
    # field with a value that the stored answer would drop.
    assert (fast is None) == (variant in (2, 4, 5, 6))


def test_the_fingerprint_on_a_streams_last_chunk_is_kept() -> None:
    # vLLM sends system_fingerprint on the last chunk (the usage one, when asked for), not the
    # first: an answer assembled from the stream carries it all the same.
    data = chat_stream(["a", "b"]).replace(
        b'"usage":', b'"system_fingerprint":"vllm-0.32.0-abc","usage":')
    result = assemble(data)
    assert result is not None and result["system_fingerprint"] == "vllm-0.32.0-abc"
