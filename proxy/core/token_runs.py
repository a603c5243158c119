"""The usual streamed answer's token events, found and cut without a Python step per event.

A streamed answer is mostly events that differ only in their text: the engine writes the same
head (id, object, created, model), the same choice fields and the same ending around each token.
``find_run`` finds the first such run in complete SSE events and returns its texts decoded at
once, so that ``proxy.core.recording`` parses only the events around it one by one.

Rules (pure, no I/O):
- A run is only ever reported where parsing each of its events on its own would give exactly the
  same answer: its first event matches a strict template (one ``data: `` line at an event's start,
  compact JSON, the head and choice keys in vLLM's order, choice 0, ``logprobs`` null or absent,
  ``finish_reason`` null, only null extras that the merge ignores or that the first event already
  applied); every later event in the run is the first one byte for byte except its text; and every
  text on its own is a complete JSON string body: well-formed UTF-8, no control character, only
  complete escapes, surrogates only as whole pairs. Decoding such texts joined is then the same as
  decoding each and joining the results.
- The run is proved, not assumed: its bytes are rebuilt from its texts and the first event's
  bytes around each, and compared with the stream. Events of other shapes after the run (finish,
  usage, ``[DONE]``) are left to the caller. Anything else (a comment or a different event inside
  the run, a second choice, logprobs, an escape or a character cut between events, garbage) gives
  no run, and the caller parses every event one by one: an answer is never wrong, only slower.
- Bounded: the template's first event is looked for in the first ``SEARCH_BYTES``; the rest is
  C-speed splitting, joining and comparing, and one scan over the texts alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from operator import itemgetter

import orjson

# Where the run's first event must end: it is the first or second event of an answer.
SEARCH_BYTES = 8192
# The marker the run is split on: this many bytes of an event's end and of the next one's start.
_MARK_END, _MARK_START = 9, 24

_NAME = rb'"[ !#-\[\]-~]*"'  # a head string: printable ASCII, no quote or backslash to decode
_NUMBER = rb"(?:0|[1-9][0-9]{0,17})"  # well inside the 64-bit integers that parse
_TEXT = (
    rb"(?:[ !#-\[\]-\x7f]++"  # plain ASCII
    rb'|\\(?:["\\/bfnrt]'  # escapes; \u only for a non-surrogate or a whole pair
    rb"|u(?![dD][89a-fA-F])[0-9a-fA-F]{4}|u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|[\xc2-\xdf][\x80-\xbf]|\xe0[\xa0-\xbf][\x80-\xbf]|[\xe1-\xec\xee\xef][\x80-\xbf]{2}"
    rb"|\xed[\x80-\x9f][\x80-\xbf]|\xf0[\x90-\xbf][\x80-\xbf]{2}|[\xf1-\xf3][\x80-\xbf]{3}"
    rb"|\xf4[\x80-\x8f][\x80-\xbf]{2})*+"  # well-formed UTF-8 (RFC 3629), nothing else
)
_HEAD = (rb'data: \{"id":' + _NAME + rb',"object":' + _NAME + rb',"created":' + _NUMBER
         + rb',"model":' + _NAME + rb',"choices":\[\{"index":0,')  # fmt: skip
_END = (rb'(?:,"logprobs":null)?,"finish_reason":null'
        rb'(?:,"(?:stop_reason|token_ids|prompt_token_ids)":null)*\}\](?:,"usage":null)?\}\n\n')
_CHAT = re.compile(_HEAD + rb'"delta":\{"content":"(' + _TEXT + rb')"\}' + _END)
_COMPLETION = re.compile(_HEAD + rb'"text":"(' + _TEXT + rb')"' + _END)
_PLAIN = re.compile(rb"[ !#-\[\]-\x7f]*+")
# The run's texts joined by a byte no text may hold, so that each is checked as a whole text.
_TEXTS = re.compile(_TEXT + rb"(?:\x00" + _TEXT + rb")*+")


@dataclass(frozen=True, slots=True)
class TokenRun:
    """``events[:first_end]``: the events up to and including the run's first, for the caller to
    parse one by one; ``text``: the decoded texts of the run's later events, in order, all for
    choice 0; ``tail``: the complete events after the run."""

    first_end: int
    text: str
    tail: bytes


def find_run(events: bytes, *, chat: bool) -> TokenRun | None:
    """The first run of two or more same-shaped token events in ``events`` (complete SSE events,
    LF line ends), or None."""
    template = _CHAT if chat else _COMPLETION
    first = template.search(events, 0, min(len(events), SEARCH_BYTES))
    if first is None or (first.start() and events[first.start() - 2 : first.start()] != b"\n\n"):
        return None  # none near the start, or not at an event's start (inside a comment, say)
    prefix, suffix = events[first.start() : first.start(1)], events[first.end(1) : first.end()]
    end = first.end()
    if not events.startswith(suffix + prefix, first.end(1)):
        return None  # the next event is not the same shape
    texts = _texts_after(events, end, prefix, suffix)
    if texts is None:
        return None
    # The proof: the run's bytes are exactly its texts with the first event's bytes around each.
    run_start = end + len(prefix)  # the second event's text
    expected = (suffix + prefix).join(texts)
    run_end = run_start + len(expected)
    if not (events.startswith(expected, run_start) and events.startswith(suffix, run_end)):
        return None
    text = _decoded(texts)
    return None if text is None else TokenRun(end, text, events[run_end + len(suffix) :])


def _texts_after(events: bytes, end: int, prefix: bytes, suffix: bytes) -> list[bytes] | None:
    """The texts of the events that follow the one ending at ``end`` in the same shape, cut out
    by C loops: a split on a short marker where one event ends and the next begins (a long one
    is searched several times slower), then the same slice of each piece. Unchecked: what each
    piece holds besides its text is proved by the caller."""
    keep_end, keep_start = min(len(suffix) - 1, _MARK_END), min(len(prefix), _MARK_START)
    marker = suffix[-keep_end:] + prefix[:keep_start]
    parts = events.split(marker)
    first = _part_ending_at(parts, end - keep_end, len(marker))
    if first is None:
        return None
    inner_start, inner_end = prefix[keep_start:], suffix[:-keep_end]
    last = len(parts) - 1  # the run's last event: the events after it are few
    while last > first and not (parts[last].startswith(inner_start)
                                and parts[last].endswith(inner_end)):  # fmt: skip
        last -= 1
    if last == first:
        return None
    text_of = itemgetter(slice(len(inner_start), -len(inner_end)))
    return list(map(text_of, parts[first + 1 : last + 1]))


def _decoded(texts: list[bytes]) -> str | None:
    """The texts decoded and joined, if each is a whole JSON string's inside on its own."""
    joined = b"".join(texts)
    if _PLAIN.fullmatch(joined):  # printable ASCII, no quote, no escape: the usual text
        return joined.decode("ascii")
    separated = b"\x00".join(texts)
    if separated.count(b"\x00") != len(texts) - 1 or not _TEXTS.fullmatch(separated):
        return None
    try:
        text = orjson.loads(b'"' + joined + b'"')
    except orjson.JSONDecodeError:
        return None  # not reachable for texts of the grammar above; parsed one by one then
    return text if isinstance(text, str) else None


def _part_ending_at(parts: list[bytes], offset: int, gap: int) -> int | None:
    """Which of ``parts`` (split on a separator ``gap`` bytes long) ends at ``offset`` of the
    bytes they came from. A loop over the parts before it only: ``offset`` is near the start."""
    end = -gap
    for index, part in enumerate(parts):
        end += gap + len(part)
        if end >= offset:
            return index if end == offset else None
    return None
