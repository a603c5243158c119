"""The fields the proxy reads, read as vLLM reads them: what the engine would take, the proxy
takes too, in one spelling; what the engine would refuse, the proxy refuses."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.errors import BadRequest
from proxy.core.inbound import Endpoint, accept


def chat(**extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})


@pytest.mark.parametrize(
    ("extra", "read"),
    [
        ({"max_tokens": "5"}, {"max_tokens": 5}),
        ({"max_tokens": 5.0}, {"max_tokens": 5}),
        ({"max_tokens": " 7 "}, {"max_tokens": 7}),
        ({"max_completion_tokens": "9", "n": 1.0}, {"max_completion_tokens": 9, "n": 1}),
        ({"seed": "1"}, {"seed": 1}),
        ({"seed": "-1"}, {"seed": -1}),
        ({"seed": 3.0}, {"seed": 3}),
        ({"temperature": "0.5"}, {"temperature": 0.5}),
        ({"temperature": "0"}, {"temperature": 0.0}),
        ({"stream": "true"}, {"stream": True}),
        ({"stream": "No"}, {"stream": False}),
        ({"stream": 1}, {"stream": True}),
        ({"stream": 0}, {"stream": False}),
        ({"max_tokens": 5, "stream": True}, {"max_tokens": 5, "stream": True}),
        ({"priority": 5.0}, {"priority": 5}),
        ({"priority": "-2"}, {"priority": -2}),
        ({"priority": "sheddable"}, {"priority": "sheddable"}),  # the proxy's own words stay
    ],
)
def test_what_vllm_would_take_is_taken_in_its_own_type(
    extra: dict[str, Any], read: dict[str, Any]
) -> None:
    inbound = accept(chat(**extra), Endpoint.CHAT)
    assert {k: inbound.body[k] for k in read} == read
    assert all(type(inbound.body[k]) is type(v) for k, v in read.items())
    assert inbound.stream is read.get("stream", False)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": "5.5"}, "max_tokens"),
        ({"max_tokens": 5.5}, "max_tokens"),
        ({"max_tokens": "five"}, "max_tokens"),
        ({"max_tokens": "0"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),  # a boolean is never a count here
        ({"max_tokens": "\uff11\uff12"}, "max_tokens"),  # digits, but not ASCII ones
        ({"n": "2x"}, "n"),
        ({"seed": "1e3"}, "seed"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": "nan"}, "temperature"),
        ({"temperature": "-1"}, "temperature"),
        ({"stream": "maybe"}, "stream"),
        ({"stream": 2}, "stream"),
    ],
)
def test_what_vllm_would_refuse_is_refused(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        accept(chat(**extra), Endpoint.CHAT)
    assert refused.value.param == param


@pytest.mark.parametrize(("field", "literal"), [
    ("seed", b"1180591620717411303424"), ("seed", b"18446744073709551616"),
    ("seed", b'"9223372036854775808"'), ("max_tokens", b"1180591620717411303424"),
    ("n", b"18446744073709551616"), ("priority", b"-9223372036854775809"),
])
def test_integers_past_64_bits_are_refused_naming_the_field(field: str, literal: bytes) -> None:
    # vLLM's own 400 (its integer fields are 64-bit); never a 500 from writing the body back.
    raw = chat()[:-1] + b',"' + field.encode() + b'":' + literal + b"}"
    try:
        inbound = accept(raw, Endpoint.CHAT)
    except BadRequest as refused:
        assert refused.param == field
    else:  # a field the proxy passes on as it came (the engine answers for it)
        assert field == "priority" and not isinstance(inbound.body[field], int)
    assert accept(chat(seed=2**63 - 1), Endpoint.CHAT).body["seed"] == 2**63 - 1
