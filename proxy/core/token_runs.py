"""The usual streamed answer's token events, found and cut without a Python step per event.

A streamed answer is mostly events that differ only in their text: the engine writes the same
head (id, object, created, model), the same choice fields and the same ending around each token.
``find_run`` finds the first such run in complete SSE events and returns its texts decoded at
once, so that ``proxy.core.recording`` parses only the events around it one by one.

Rules (pure, no I/O):
- A run is only ever reported where parsing each of its events on its own would give exactly the
  same answer: its first event matches a strict template (one ``data: `` line at an event's start,
  compact JSON, the head and choice keys in vLLM's order, choice 0, ``logprobs`` and
  ``finish_reason`` null, only null extras that the merge ignores or that the first event already
  applied); every later event in the run is the first one byte for byte except its text; and every
  text on its own is a complete JSON string body: well-formed UTF-8, no control character, only
  complete escapes, surrogates only as whole pairs. Decoding such texts joined is then the same as
  decoding each and joining the results.
- Anything else (a comment or a different event inside the run, a second choice, logprobs, an
  escape or a character cut between events, garbage) ends the run or gives no run: the caller's
  general path takes those bytes, so an answer is never wrong, only slower.
- Bounded: the template's first event is looked for in the first ``SEARCH_BYTES``; the rest is
  C-speed splitting and one regular-expression pass over the texts alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

# Where the run's first event must end: it is the first or second event of an answer.
SEARCH_BYTES = 8192

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
_END = (rb',"logprobs":null,"finish_reason":null'
        rb'(?:,"(?:stop_reason|token_ids|prompt_token_ids)":null)*\}\](?:,"usage":null)?\}\n\n')
_CHAT = re.compile(_HEAD + rb'"delta":\{"content":"(' + _TEXT + rb')"\}' + _END)
_COMPLETION = re.compile(_HEAD + rb'"text":"(' + _TEXT + rb')"' + _END)
_ONE_TEXT = re.compile(_TEXT)
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
    start, text_start, text_end, end = first.start(), first.start(1), first.end(1), first.end()
    prefix, suffix = events[start:text_start], events[text_end:end]
    between = suffix + prefix  # from one event's text to the next one's
    if not events.startswith(between, text_end):
        return None  # the next event is not the same shape
    parts = events.split(between)
    first_part = _part_ending_at(parts, text_end, len(between))
    if first_part is None:
        return None  # a split overlapping the first event's text: not the usual stream
    texts = parts[first_part + 1 :]
    last = texts.pop()
    cut = last.find(suffix)
    if cut >= 0 and _ONE_TEXT.fullmatch(last, 0, cut):
        texts.append(last[:cut])
        tail = last[cut + len(suffix) :]
    else:
        tail = prefix + last  # the event after the run only starts like one of it
    joined = b"\x00".join(texts)
    if not texts or joined.count(b"\x00") != len(texts) - 1 or not _TEXTS.fullmatch(joined):
        return None
    try:
        text = orjson.loads(b'"' + b"".join(texts) + b'"')
    except orjson.JSONDecodeError:
        return None  # not reachable for texts of the grammar above; today's path then
    return TokenRun(end, text, tail) if isinstance(text, str) else None


def _part_ending_at(parts: list[bytes], offset: int, gap: int) -> int | None:
    """Which of ``parts`` (split on a separator ``gap`` bytes long) ends at ``offset`` of the
    bytes they came from. A loop over the parts before it only: ``offset`` is near the start."""
    end = -gap
    for index, part in enumerate(parts):
        end += gap + len(part)
        if end >= offset:
            return index if end == offset else None
    return None
