"""Recording a stream with its run of token events taken whole (``proxy.core.token_runs``) gives
exactly what parsing every event one by one gives: the same answer, byte for byte, or none.

The reference is the same assembler with the run search turned off, i.e. every event through the
event-by-event path that recorded every answer before the run search existed."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.recording import StreamAssembler
from proxy.core.token_runs import find_run


class EventByEvent(StreamAssembler):
    """The reference: no run search, every complete event parsed on its own."""

    def _complete(self, events: bytes) -> None:
        self._parse(events)


def outcome(cls: type[StreamAssembler], data: bytes, *, chat: bool, cuts: tuple[int, ...],
            max_bytes: int = 1 << 22) -> tuple[bytes | None, bool, bool]:  # fmt: skip
    """What an assembler fed ``data`` in pieces (cut at ``cuts``) ends with: the stored answer's
    bytes (None: nothing stored), ``storable`` and ``done``."""
    asm = cls(chat=chat, max_bytes=max_bytes)
    start = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        asm.feed(data[start:cut])
        start = cut
    result = asm.result()
    return (None if result is None else orjson.dumps(result)), asm.storable, asm.done


def assert_same(data: bytes, *, chat: bool, cuts: tuple[int, ...] = (), max_bytes: int = 1 << 22
                ) -> tuple[bytes | None, bool, bool]:  # fmt: skip
    got = outcome(StreamAssembler, data, chat=chat, cuts=cuts, max_bytes=max_bytes)
    assert got == outcome(EventByEvent, data, chat=chat, cuts=cuts, max_bytes=max_bytes)
    return got


# -- events, written as bytes so that any text (broken ones included) can go in ----------------

HEAD = b'"id":"chatcmpl-1","object":"chat.completion.chunk","created":1764000000,"model":"m"'


def token(text: bytes, *, chat: bool = True, head: bytes = HEAD, extra: bytes = b"",
          index: bytes = b"0", after: bytes = b"") -> bytes:  # fmt: skip
    """One token event: ``text`` goes between the quotes as it is, unchecked."""
    field = b'"delta":{"content":"' + text + b'"}' if chat else b'"text":"' + text + b'"'
    choice = b'{"index":' + index + b"," + field + b',"logprobs":null,"finish_reason":null'
    return b"data: {" + head + b',"choices":[' + choice + extra + b"}]" + after + b"}\n\n"


def role() -> bytes:
    return (b"data: {" + HEAD + b',"choices":[{"index":0,"delta":{"role":"assistant",'
            b'"content":""},"logprobs":null,"finish_reason":null}]}\n\n')  # fmt: skip


def finish(*, chat: bool = True, reason: bytes = b'"stop"') -> bytes:
    field = b'"delta":{}' if chat else b'"text":""'
    return (b"data: {" + HEAD + b',"choices":[{"index":0,' + field
            + b',"logprobs":null,"finish_reason":' + reason + b',"stop_reason":null}]}\n\n')


USAGE = (b"data: {" + HEAD + b',"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,'
         b'"total_tokens":7}}\n\n')  # fmt: skip
DONE = b"data: [DONE]\n\n"


def answer(texts: list[bytes], *, chat: bool = True, **shape: Any) -> bytes:
    lead = role() if chat else b""
    body = b"".join(token(t, chat=chat, **shape) for t in texts)
    return lead + body + finish(chat=chat) + USAGE + DONE


# -- generated streams --------------------------------------------------------------------------

def mostly(usual: Any, others: st.SearchStrategy[Any], odds: int = 4) -> st.SearchStrategy[Any]:
    """``usual`` but one time in ``odds``, then one of ``others``."""
    return st.integers(0, odds - 1).flatmap(lambda i: st.just(usual) if i else others)


# Texts as an engine writes them, and pieces of a JSON string's inside that are not: escapes,
# pairs, lone surrogates, raw bytes of a character cut in two, control characters, quotes.
TEXTS = st.text(max_size=6).map(lambda s: orjson.dumps(s)[1:-1])
FRAGMENTS = st.one_of(
    TEXTS,
    st.sampled_from([
        b"\\n", b'\\"', b"\\\\", b"\\/", b"\\u00e9", b"\\u20AC", b"\\ud83d\\ude00", b"\\uD83D",
        b"\\ud83d", b"\\uDE00",
        b"\\ude00", b"\\u12", b"\\x", b"\\", b"\xe2\x82", b"\xac", b"\xc3\xa9", b"\xed\xa0\x80",
        b"\xf0\x9f\x98\x80", b"\xff", b"\x01", b"\x7f", b'"', b"\n", b"\r", b"}", b"\\u0000",
        b'"},"x":1,"y":"', b"\x00",
    ]),
)  # fmt: skip
HEADS = st.sampled_from([
    b'"id":"x","object":"o","created":0,"model":"m"', b'"id":"\xc3\xa9","object":"o",'
    b'"created":1,"model":"m"', b'"id":"x","object":"o","created":01,"model":"m"',
    b'"id":"x","object":"o","created":99999999999999999999999,"model":"m"',
    b'"id":"x","object":"o","created":-1,"model":"m"', b'"created":5,"model":"m"',
    b'"id":"x","object":"o","created":1,"model":"m","error":null', b'"id":"a\\"b","object":"o",'
    b'"created":1,"model":"m"', b'"id": "x", "object": "o", "created": 1, "model": "m"',
])  # fmt: skip
USUAL_EXTRAS = st.sampled_from([
    b"", b',"stop_reason":null', b',"token_ids":null',
    b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null',
])  # fmt: skip
EXTRAS = st.sampled_from([
    b',"stop_reason":7', b',"other":null', b',"token_ids":[1]', b',"logprobs":{"content":[]}',
    b',"index":1', b',"delta":{"content":"x"}', b',"text":"x"', b',"stop_reason":null,"x":0',
])  # fmt: skip
OTHERS = st.sampled_from([
    b": keep-alive\n\n", b"\n", b"id: 3\n", b"event: message\n", b"data: junk\n\n",
    b'data: {"error":{"message":"boom"}}\n\n', DONE, USAGE, b"data:" + b" [DONE]\n\n",
    b"data: {" + HEAD + b',"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]},'
    b'"logprobs":null,"finish_reason":null}]}\n\n',
    b"data: {" + HEAD + b',"choices":[{"index":1,"delta":{"content":"b"},"logprobs":null,'
    b'"finish_reason":"stop"}]}\n\n',
])  # fmt: skip


# Whole texts that stand alone, and halves of one (an escape, a pair, a character) that do not.
WHOLE = st.sampled_from([
    b"\\n", b'\\"', b"\\\\", b"\\/", b"\\u00e9", b"\\u20AC", b"\\ud83d\\ude00", b"\xc3\xa9",
    b"\xf0\x9f\x98\x80", b"\x7f", b"\\u0000", b"\xef\xbf\xbf",
])  # fmt: skip
HALVES = st.sampled_from([
    (b"\\ud83d", b"\\ude00"), (b"a\\uD83D", b"\\uDE00b"), (b"\xe2\x82", b"\xac"),
    (b"\xf0\x9f", b"\x98\x80"), (b"\\", b"n"), (b"\\u00", b"e9"), (b"x\\", b"u00e9"),
    (b"\\", b"\\"), (b"\\", b'"'),
])  # fmt: skip


SAME_LENGTH = st.sampled_from([
    (b'"index":0', b'"index":1'), (b'"logprobs":null', b'"logprobs":true'),
    (b'"finish_reason":null', b'"finish_reason":true'),
    (b'"stop_reason":null', b'"stop_reason":true'), (b'"token_ids":null', b'"token_ids":true'),
    (b'"model":"m"', b'"model":"n"'),
    (b'"id":"chatcmpl-1"', b'"error":"tcmpl-1"'),
])  # fmt: skip


@st.composite
def usual_streams(draw: st.DrawFn) -> tuple[bytes, bool]:
    """Streams as engines send them: the texts whole, now and then one cut in two."""
    chat = draw(st.booleans())
    texts = st.one_of(TEXTS, WHOLE).map(lambda text: (text,))
    if draw(st.booleans()):
        texts = st.one_of(texts, HALVES)
    pieces = [piece for group in draw(st.lists(texts, min_size=2, max_size=24)) for piece in group]
    head = draw(st.sampled_from([HEAD, b'"id":"x","object":"o","created":0,"model":"m"']))
    shape = {"head": head, "extra": draw(USUAL_EXTRAS),
             "after": draw(st.sampled_from([b"", b',"usage":null']))}  # fmt: skip
    events = [role()] if chat and draw(st.booleans()) else []
    tokens = [token(piece, chat=chat, **shape) for piece in pieces]
    if draw(st.booleans()):  # one event differs, in the same number of bytes
        where, (old, new) = draw(st.integers(0, len(tokens) - 1)), draw(SAME_LENGTH)
        tokens[where] = tokens[where].replace(old, new)
    events += tokens
    if draw(st.booleans()):
        events.insert(draw(st.integers(0, len(events))), b": keep-alive\n\n")
    events += [finish(chat=chat), USAGE, DONE]
    data = b"".join(events)
    return (data.replace(b"\n", b"\r\n") if draw(st.booleans()) else data), chat


@st.composite
def token_events(draw: st.DrawFn, chat: bool) -> list[bytes]:
    """A run's worth of token events in one shape. Now and then the texts are a hostile text cut
    anywhere into pieces, and now and then an event has another shape."""
    if draw(st.booleans()):  # one fragment an event: an escape pair or a character may be cut
        pieces = draw(st.lists(FRAGMENTS, min_size=2, max_size=12))
    else:  # cut anywhere
        text = b"".join(draw(st.lists(FRAGMENTS, max_size=12)))
        cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    extra = mostly(b"", st.one_of(USUAL_EXTRAS, USUAL_EXTRAS, EXTRAS), 2)
    usual = {"head": draw(mostly(HEAD, HEADS)), "extra": draw(extra),
             "after": draw(mostly(b"", st.sampled_from([b',"usage":null', b',"usage":{}'])))}
    events = []
    for piece in pieces:
        shape = dict(usual)
        if draw(st.integers(0, 15)) == 0:
            shape |= {"head": draw(HEADS), "extra": draw(st.one_of(EXTRAS, USUAL_EXTRAS))}
        kind = draw(mostly(chat, st.just(not chat), 20))
        event = token(piece, chat=kind, **shape)
        if draw(st.integers(0, 15)) == 0:  # another event of the same length
            old, new = draw(SAME_LENGTH)
            event = event.replace(old, new)
        events.append(event)
    return events




@st.composite
def odd_streams(draw: st.DrawFn) -> tuple[bytes, bool]:
    """Streams with anything in them: odd shapes, junk events, errors, no end, bytes after it."""
    chat = draw(st.booleans())
    events = [role()] if chat and draw(st.integers(0, 4)) else []
    events += draw(token_events(chat))
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        events.insert(draw(st.integers(0, len(events))), draw(OTHERS))
    reason = draw(mostly(b'"stop"', st.sampled_from([b'"abort"', b"null"])))
    events.append(finish(chat=chat, reason=reason))
    events += draw(mostly([USAGE, DONE], st.sampled_from([[DONE], [], [DONE, b"data: x\n\n"]])))
    data = b"".join(events)
    if draw(st.integers(0, 5)) == 0:
        data = data.replace(b"\n", b"\r\n")
    return data, chat


CUTS = st.lists(st.integers(0, 1 << 16), max_size=4)


@settings(max_examples=400)
@given(usual_streams(), CUTS)
def test_usual_streams_are_recorded_exactly_as_event_by_event(
    stream: tuple[bytes, bool], cuts: list[int]
) -> None:
    data, chat = stream
    assert_same(data, chat=chat)  # the relay's case: the whole stream at once
    assert_same(data, chat=chat, cuts=tuple(cuts))


@settings(max_examples=400)
@given(odd_streams(), CUTS)
def test_odd_streams_are_recorded_exactly_as_event_by_event(
    stream: tuple[bytes, bool], cuts: list[int]
) -> None:
    data, chat = stream
    assert_same(data, chat=chat)
    assert_same(data, chat=chat, cuts=tuple(cuts))


@settings(max_examples=100)
@given(st.one_of(usual_streams(), odd_streams()), st.integers(1, 4000))
def test_the_size_bound_is_the_same(stream: tuple[bytes, bool], max_bytes: int) -> None:
    data, chat = stream
    assert_same(data, chat=chat, max_bytes=max_bytes)


@settings(max_examples=200)
@given(st.binary(max_size=600), st.booleans())
def test_junk_is_treated_the_same(junk: bytes, chat: bool) -> None:
    assert_same(junk, chat=chat)
    assert_same(answer([b" a", b" b"], chat=chat)[:300] + junk + DONE, chat=chat)


# -- the cases that matter, one by one ----------------------------------------------------------


@pytest.mark.parametrize("chat", [True, False])
def test_the_usual_stream_is_taken_as_a_run(chat: bool) -> None:
    texts = [f" w{i}".encode() for i in range(50)] + [b"\\u00e9\\ud83d\\ude00\xc3\xa9\\n\\\""]
    data = answer(texts, chat=chat, extra=b',"token_ids":null')
    run = find_run(data, chat=chat)
    assert run is not None and run.tail.endswith(DONE)
    assert run.text == "".join(f" w{i}" for i in range(1, 50)) + "é😀é\n\""
    stored, _, _ = assert_same(data, chat=chat)
    assert stored is not None


def test_a_stream_without_logprobs_fields_is_taken_as_a_run() -> None:
    data = answer([b"a", b"b", b"c"]).replace(b',"logprobs":null', b"")
    run = find_run(data, chat=True)
    assert run is not None and run.text == "bc"
    assert assert_same(data, chat=True)[0] is not None


@pytest.mark.parametrize(
    "texts",
    [
        [b"a\\", b"n"],  # an escape cut between two events
        [b"\\ud83d", b"\\ude00"],  # a surrogate pair cut between two events
        [b"\xe2\x82", b"\xac"],  # a character's bytes cut between two events
        [b"\\uD83D", b"x"],  # a lone surrogate
        [b"a\x01", b"b"],  # a control character
        [b'a"', b"b"],  # a bare quote
        [b"a", b'b"},"x":"'],  # a text that closes the field early
    ],
)
def test_texts_that_do_not_stand_alone_are_never_joined(texts: list[bytes]) -> None:
    data = answer([b"first", *texts, b"last"])
    stored, storable, _ = assert_same(data, chat=True)
    assert stored is None and not storable  # parsed one by one: not JSON, not stored


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("extra", [
    b',"stop_reason":7', b',"other":null', b',"token_ids":[1]', b',"logprobs":{"content":[]}',
    b',"index":1', b',"delta":{"content":"x"}', b',"text":"x"', b',"finish_reason":"stop"',
])  # fmt: skip
def test_other_choice_fields_are_parsed_one_by_one(chat: bool, extra: bytes) -> None:
    """A second field of the same name wins in JSON: the run's shape is only ever the known one."""
    data = answer([b"a", b"b", b"c", b"d"], chat=chat, extra=extra)
    assert find_run(data, chat=chat) is None
    assert_same(data, chat=chat)


def test_a_run_ends_where_another_event_comes() -> None:
    """A comment, a second choice or a differently shaped event inside the run: what comes after
    is parsed one by one, and the answer is the same."""
    second = token(b"two", index=b"1")
    for odd in (b": keep-alive\n\n", second, token(b"x", extra=b',"stop_reason":null')):
        data = role() + token(b"a") + token(b"b") + odd + token(b"c") + token(b"d") + finish()
        data += finish().replace(b'"index":0', b'"index":1') + DONE
        assert_same(data, chat=True)


@pytest.mark.parametrize("change", [
    (b'"index":0', b'"index":1'), (b'"logprobs":null', b'"logprobs":true'),
    (b'"finish_reason":null', b'"finish_reason":true'),
    (b'"id":"chatcmpl-1"', b'"error":"tcmpl-1"'),
])  # fmt: skip
def test_an_event_of_the_same_length_inside_the_run_is_seen(change: tuple[bytes, bytes]) -> None:
    odd = token(b"c").replace(*change)
    data = role() + token(b"a") + token(b"b") + odd + token(b"d") + token(b"e") + finish() + DONE
    assert find_run(data, chat=True) is None
    assert_same(data, chat=True)


def test_an_event_shape_inside_a_comment_is_not_an_event() -> None:
    data = role() + b": " + token(b"hidden") + token(b"a") + token(b"b") + finish() + DONE
    stored, _, _ = assert_same(data, chat=True)
    assert stored is not None and b'"content":"ab"' in stored


def test_bytes_after_done_and_a_late_run_are_not_stored() -> None:
    data = answer([b"a", b"b"]) + token(b"c") + token(b"d")
    assert assert_same(data, chat=True) == (None, False, True)


def test_no_run_in_a_stream_of_another_shape() -> None:
    assert find_run(answer([b"a", b"b"], chat=False), chat=True) is None
    assert find_run(answer([b"a", b"b"], extra=b',"logprobs2":null'), chat=True) is None
    far = b": " + b"x" * 9000 + b"\n\n" + answer([b"a", b"b"])  # not near the start
    assert find_run(far, chat=True) is None
    assert assert_same(far, chat=True)[0] is not None
