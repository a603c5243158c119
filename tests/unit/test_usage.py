import orjson
import pytest

from proxy.core.deadline import client_timeout
from proxy.core.errors import BadRequest
from proxy.core.usage import (
    StreamTail,
    Usage,
    UsageStrip,
    asks_for_usage,
    usage_of_body,
    with_usage,
)
from proxy.fleet.discovery import ModelsError, missing_models, parse_models
from proxy.observe.metrics import TenantLabels

CHUNK = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
    b'"total_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def test_usage_found_at_the_end_of_a_stream_in_any_cut() -> None:
    whole = CHUNK * 3 + USAGE + DONE
    for cut in range(1, len(whole)):
        tail = StreamTail()
        tail.feed(whole[:cut])
        tail.feed(whole[cut:])
        assert tail.usage() == Usage(7, 3, 4)
    broken = StreamTail()
    broken.feed(CHUNK + USAGE)  # no [DONE]: the stream did not end normally
    assert broken.usage() is None


def test_strip_removes_only_the_usage_event_wherever_reads_are_cut() -> None:
    whole = CHUNK * 2 + USAGE + DONE
    for cut in range(1, len(whole)):
        strip = UsageStrip()
        out = strip(whole[:cut]) + strip(whole[cut:]) + strip.flush()
        assert out == CHUNK * 2 + DONE, cut


def test_strip_removes_the_usage_event_after_an_event_longer_than_it_holds_back() -> None:
    # A first event past 64 KiB (an echoed prompt, prompt logprobs) goes out as it comes; the
    # usage event after it is still removed, however the reads are cut.
    big = b'data: {"choices":[{"text":"' + b"x" * 200_000 + b'"}]}\n\n'
    whole = big + CHUNK + USAGE + DONE
    for cuts in ([70_000], [70_000, len(big) - 1], [70_000, len(big)], [100, 150_000],
                 [len(big) - 1, len(big) + 5], [80_000, len(big) + len(CHUNK) + 3]):
        strip, out, at = UsageStrip(), b"", 0
        for cut in [*cuts, len(whole)]:
            out += strip(whole[at:cut])
            at = cut
        assert out + strip.flush() == big + CHUNK + DONE, cuts
        assert not strip.passthrough


def test_strip_leaves_crlf_streams_alone() -> None:
    strip = UsageStrip()
    data = b'data: {"choices":[]}\r\n\r\ndata: {"a'
    assert strip(data) == data


def test_plain_body_usage_and_asking_for_it() -> None:
    body = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
    assert usage_of_body(body) == Usage(2, 1, 0)
    assert usage_of_body(b'{"usage": "x"}') is None and usage_of_body(b"nope") is None
    asked, injected = with_usage({"stream": True, "stream_options": {"x": 1}})
    assert injected and asked["stream_options"] == {"x": 1, "include_usage": True}
    _, injected = with_usage({"stream_options": {"include_usage": True}})
    assert not injected
    malformed, injected = with_usage({"stream_options": "yes"})
    assert not injected and malformed["stream_options"] == "yes"


def test_client_timeout_sources() -> None:
    assert client_timeout(None, {}) is None
    assert client_timeout("2.5", {"timeout": 10}) == 2.5
    assert client_timeout(" 30 ", {"timeout": 1}) == 1.0
    for header in ("0", "-1", "nan", "inf", "soon", "1" * 40):
        with pytest.raises(BadRequest) as info:
            client_timeout(header, {})
        assert info.value.param == "X-Request-Timeout"
    for value in (0, -2, True, "5", float("inf")):
        with pytest.raises(BadRequest) as info:
            client_timeout(None, {"timeout": value})
        assert info.value.param == "timeout"


def test_tenant_labels_are_bounded() -> None:
    labels = TenantLabels(max_dynamic=2)
    labels.know(["default", "acme"])
    assert [labels(t) for t in ("acme", "r1", "r2", "r3", "r1", "", "default")] == [
        "acme", "r1", "r2", "other", "r1", "other", "default",
    ]  # fmt: skip


def test_engine_model_lists() -> None:
    body = orjson.dumps({"object": "list", "data": [{"id": "a"}, {"id": 3}, "x", {"id": "b"}]})
    assert parse_models(body) == ("a", "b")
    for bad in (b"[]", b"{", b'{"data": 1}'):
        with pytest.raises(ModelsError):
            parse_models(bad)
    assert missing_models(["a", "lora", "b"], ["b", "a"]) == ("lora",)


@pytest.mark.parametrize(("value", "asked"), [
    (True, True), (1, True), (1.0, True), ("true", True), ("YES", True), ("on", True),
    (False, False), (0, False), ("false", False), ("no", False), (None, False), (2, False),
    ([], False),
])
def test_include_usage_is_read_as_vllm_reads_it(value: object, asked: bool) -> None:
    body = {"stream": True, "stream_options": {"include_usage": value}}
    assert asks_for_usage(body) is asked
    out, injected = with_usage(body)
    assert injected is not asked
    assert out["stream_options"]["include_usage"] == (value if asked else True)


def test_continuous_usage_stats_go_where_the_client_did_not_ask_for_usage() -> None:
    # vLLM honours continuous_usage_stats only with include_usage: without it, the client's
    # stream carries no usage at all, and the proxy's own include_usage must not change that.
    out, injected = with_usage({"stream": True,
                                "stream_options": {"continuous_usage_stats": True}})
    assert injected and out["stream_options"] == {"include_usage": True}
    body = {"stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    assert with_usage(body) == (body, False)
