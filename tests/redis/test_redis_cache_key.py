"""Cacheability and key derivation (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.cache_key import CacheConfig, cache_key, canonical_body, decide
from proxy.core.errors import ConfigError

SECRET = b"s" * 32
CHAT = "/v1/chat/completions"
STREAM = {"temperature": 0, "stream": True}
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def body(**extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize(
    ("extra", "cache_control", "expected"),
    [
        ({"temperature": 0}, None, (True, True, "")),
        ({"temperature": 0.0}, None, (True, True, "")),
        ({"temperature": 0.7, "seed": 3}, None, (True, True, "")),
        ({"temperature": 0.7}, None, (False, False, "sampling")),
        ({}, None, (False, False, "sampling")),  # default temperature samples
        ({"seed": True}, None, (False, False, "sampling")),
        # vLLM reads seed -1 as no seed: every answer is sampled anew.
        ({"temperature": 0.7, "seed": -1}, None, (False, False, "sampling")),
        ({"temperature": 0, "seed": -1}, None, (True, True, "")),
        ({"temperature": 0.7, "seed": -2}, None, (True, True, "")),
        ({"temperature": 0, "n": 2}, None, (False, False, "n_not_1")),
        ({"temperature": 0, "n": 1}, None, (True, True, "")),
        ({"temperature": 0}, "no-store", (False, False, "no_store")),
        ({"temperature": 0}, "No-Cache", (False, True, "no_cache")),
        ({"temperature": 0}, "max-age=0, no-store", (False, False, "no_store")),
        # Streamed answers the cache could never store: bypassed, so they never wait either.
        ({**STREAM, "logprobs": True}, None, (False, False, "logprobs")),
        ({**STREAM, "logprobs": 0}, None, (False, False, "logprobs")),  # completions: a count
        ({**STREAM, "top_logprobs": 2}, None, (False, False, "logprobs")),
        ({**STREAM, "logprobs": False}, None, (True, True, "")),
        ({**STREAM, "logprobs": True}, "no-cache", (False, False, "logprobs")),
        ({**STREAM, "tools": TOOLS}, None, (False, False, "tools")),
        ({**STREAM, "functions": [{"name": "f"}]}, None, (False, False, "tools")),
        ({**STREAM, "tools": TOOLS, "tool_choice": "none"}, None, (True, True, "")),
        ({**STREAM, "tools": []}, None, (True, True, "")),
        ({**STREAM, "return_token_ids": True}, None, (False, False, "token_ids")),
        ({**STREAM, "return_token_ids": False}, None, (True, True, "")),
        ({"temperature": 0, "return_token_ids": True}, None, (True, True, "")),
        # Transport fields the key leaves out, in a shape the engine may refuse: to the engine.
        ({"temperature": 0, "stream_options": {"include_usage": True}}, None,
         (False, False, "transport")),
        ({"temperature": 0, "stream": False, "stream_options": {}}, None,
         (False, False, "transport")),
        ({**STREAM, "stream_options": "x"}, None, (False, False, "transport")),
        ({**STREAM, "stream_options": {"include_usage": "maybe"}}, None,
         (False, False, "transport")),
        ({**STREAM, "stream_options": {"include_usage": 2}}, None, (False, False, "transport")),
        ({**STREAM, "stream_options": {"other": True}}, None, (False, False, "transport")),
        ({**STREAM, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         None, (False, False, "transport")),
        ({**STREAM, "prompt_logprobs": 1}, None, (False, False, "transport")),
        ({**STREAM, "stream_options": {"include_usage": "yes"}}, None, (True, True, "")),
        ({**STREAM, "stream_options": {"include_usage": 1, "continuous_usage_stats": False}},
         None, (True, True, "")),
        ({**STREAM, "stream_options": None}, None, (True, True, "")),
        ({**STREAM, "stream_options": {}}, None, (True, True, "")),
        ({"temperature": 0, "stream_options": None}, None, (True, True, "")),
        ({"temperature": 0, "prompt_logprobs": 1}, None, (True, True, "")),
        # A disaggregated request's answer names blocks kept for it alone, for a while.
        ({"temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}, None,
         (False, False, "transfer")),
        ({"temperature": 0, "ec_transfer_params": {}}, None, (False, False, "transfer")),
        ({"temperature": 0, "kv_transfer_params": None}, None, (True, True, "")),
        # The JSON answer is stored whole, logprobs and tool calls included.
        ({"temperature": 0, "logprobs": True}, None, (True, True, "")),
        ({"temperature": 0, "stream": False, "tools": TOOLS}, None, (True, True, "")),
    ],
)
def test_cacheability(
    extra: dict[str, object], cache_control: str | None, expected: tuple[bool, bool, str]
) -> None:
    policy = decide(body(**extra), cache_control, enabled=True)
    assert (policy.read, policy.write, policy.reason) == expected


def test_disabled_by_config() -> None:
    policy = decide(body(temperature=0), None, enabled=False)
    assert policy.bypass and policy.reason == "disabled"


def test_transport_fields_do_not_change_the_key() -> None:
    a = body(temperature=0)
    b = body(temperature=0.0, stream=True, stream_options={"include_usage": True}, priority=5)
    key = cache_key(SECRET, tenant="t", model="m", endpoint=CHAT, body=a)
    assert key == cache_key(SECRET, tenant="t", model="m", endpoint=CHAT, body=b)


def test_everything_else_changes_the_key() -> None:
    base = cache_key(SECRET, tenant="t", model="m", endpoint=CHAT, body=body(temperature=0))
    variants = [
        cache_key(SECRET, tenant="u", model="m", endpoint=CHAT, body=body(temperature=0)),
        cache_key(SECRET, tenant="t", model="n", endpoint=CHAT, body=body(temperature=0)),
        cache_key(
            SECRET, tenant="t", model="m", endpoint="/v1/completions", body=body(temperature=0)
        ),
        cache_key(
            SECRET, tenant="t", model="m", endpoint=CHAT, body=body(temperature=0, max_tokens=5)
        ),
        cache_key(b"x" * 32, tenant="t", model="m", endpoint=CHAT, body=body(temperature=0)),
    ]
    assert base not in variants and len(set(variants)) == len(variants)


def test_fields_are_length_prefixed() -> None:
    # "ab" + "c" and "a" + "bc" must not collide.
    one = cache_key(SECRET, tenant="ab", model="c", endpoint=CHAT, body={})
    two = cache_key(SECRET, tenant="a", model="bc", endpoint=CHAT, body={})
    assert one != two


def test_canonical_body_sorts_and_normalises_the_top_level_only() -> None:
    assert canonical_body({"b": 1.0, "a": [2.0, 2.5], "stream": True}) == b'{"a":[2.0,2.5],"b":1}'


def test_order_and_spelling_below_the_top_level_are_part_of_the_key() -> None:
    # A JSON schema's property order is the order of the output's keys; a template renders
    # tools and its variables with their keys in order, and 2.0 as "2.0".
    def key(**fields: object) -> str:
        body = {"messages": [{"role": "user", "content": "json"}], "temperature": 0, **fields}
        return cache_key(SECRET, tenant="t", model="m", endpoint=CHAT, body=body)

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    swapped = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert key(response_format={"type": "json_schema", "json_schema": {"schema": schema}}) != key(
        response_format={"type": "json_schema", "json_schema": {"schema": swapped}})
    assert key(chat_template_kwargs={"v": 2.0}) != key(chat_template_kwargs={"v": 2})
    # The request's own parameters are read by name and as numbers.
    assert key(max_tokens=8, top_p=1.0) == key(top_p=1, max_tokens=8.0)


@settings(deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=5),
        st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=5)),
        max_size=6,
    )
)
def test_key_ignores_key_order(raw: dict[str, object]) -> None:
    reordered = dict(reversed(list(raw.items())))
    one = cache_key(SECRET, tenant="t", model="m", endpoint=CHAT, body=raw)
    assert one == cache_key(SECRET, tenant="t", model="m", endpoint=CHAT, body=reordered)


def test_config_validation_names_fields() -> None:
    with pytest.raises(ConfigError) as exc:
        CacheConfig.from_mapping({"ttl_s": 0}, "cache")
    assert exc.value.field == "cache.ttl_s"
    with pytest.raises(ConfigError) as exc:
        CacheConfig.from_mapping({"backend": "redis"}, "cache")
    assert exc.value.field == "cache.secret"
    with pytest.raises(ConfigError) as exc:
        CacheConfig.from_mapping({"tll_s": 3}, "cache")
    assert exc.value.field == "cache.tll_s"
    cfg = CacheConfig.from_mapping({"backend": "redis", "secret": "x" * 16}, "cache")
    assert "x" * 16 not in repr(cfg)
