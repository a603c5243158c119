"""Token usage of an answer, read from the engine's own ``usage``, for per-tenant accounting.

Rules (pure, no I/O):
- A streamed answer's usage is the last data event before ``data: [DONE]`` (vLLM sends it there
  when ``stream_options.include_usage`` is set). It is found once, at the end, in the last few
  reads of the stream: the relay keeps references to them and parses nothing per event.
- When the proxy asked for usage on the client's behalf, that final usage event is removed from
  the client's stream with a substring check per read; only a read that contains the marker is
  split into events. Reads are re-cut on event boundaries while stripping so that an event split
  over two reads is still recognised (an engine framing events with CRLF is passed through as is).
- A non-streamed answer's usage is in its body, parsed once.
- ``cached`` is ``usage.prompt_tokens_details.cached_tokens`` when the engine reports it, else 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

# vLLM (pydantic) and the simulator (orjson) both write compact JSON: no space after the colon.
_USAGE_MARK = b'"choices":[]'
_DONE = b"data: [DONE]"
_TAIL_READS = 8
_MAX_CARRY = 64 * 1024


@dataclass(frozen=True)
class Usage:
    prompt: int
    completion: int
    cached: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def usage_of(obj: object) -> Usage | None:
    """The ``usage`` of a parsed response or chunk, if it has a sane one."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    if prompt is None or completion is None:
        return None
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt, completion, cached or 0)


def usage_of_body(body: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) JSON answer."""
    if b'"usage"' not in body:
        return None
    try:
        return usage_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


# The strings vLLM's request model (pydantic, lax) reads as booleans, true and false.
TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


def asks_for_usage(body: Mapping[str, Any]) -> bool:
    """Whether the client asked for a stream's usage chunk, read as vLLM reads
    ``stream_options.include_usage`` (``1``, ``"true"``, ``"yes"`` count, as there)."""
    options = body.get("stream_options")
    if not isinstance(options, dict):
        return False
    value = options.get("include_usage")
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    return isinstance(value, str) and value.lower() in TRUE_WORDS


def with_usage(body: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body asking the engine for a final usage chunk; True if the client had not asked.
    Where it had not, its ``continuous_usage_stats`` goes too: vLLM honours that only with
    ``include_usage``, so the client's stream stays as vLLM would have sent it."""
    out = dict(body)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return out, False  # malformed: the engine's own 400 says so
    if asks_for_usage(body):
        return out, False
    kept = {k: v for k, v in (options or {}).items() if k != "continuous_usage_stats"}
    out["stream_options"] = {**kept, "include_usage": True}
    return out, True


class StreamTail:
    """Keeps the last few reads of a stream (references only) to find its usage at the end."""

    def __init__(self) -> None:
        self._reads: deque[bytes] = deque(maxlen=_TAIL_READS)
        # Called once per read on the relay's hot path: the deque's own append, no Python frame.
        self.feed: Callable[[bytes], None] = self._reads.append

    def usage(self) -> Usage | None:
        tail = b"".join(self._reads).replace(b"\r\n", b"\n")
        end = tail.rfind(_DONE)
        if end < 0:
            return None
        start = tail.rfind(b"data:", 0, end)
        if start < 0:
            return None
        event = tail[start + 5 : end].strip()
        if b'"usage"' not in event:
            return None
        try:
            return usage_of(orjson.loads(event))
        except orjson.JSONDecodeError:
            return None


class UsageStrip:
    """Removes the final usage event from a relayed stream (the client did not ask for it)."""

    # A read the strip leaves as it is: it holds nothing back (``carry`` empty, or
    # ``passthrough``), the read ends between events, and it has no usage event
    # (``MARK``). The relay's raw path checks these itself, without a call per read.
    MARK = _USAGE_MARK

    def __init__(self) -> None:
        self.carry = b""  # the start of an event whose end has not come yet
        self.passthrough = False  # not vLLM's framing: the stream is left as it is
        # Inside an event longer than ``_MAX_CARRY`` (a large first event: echoed prompts, prompt
        # logprobs): far too long to be the usage event, it goes out as it comes, and stripping
        # resumes after its end. ``_newline``: the last byte seen was a newline.
        self.inside = False
        self._newline = False

    def __call__(self, chunk: bytes) -> bytes:
        if self.passthrough:
            return chunk
        if self.inside:
            return self._through_long_event(chunk)
        if self.carry:
            chunk, self.carry = self.carry + chunk, b""
        if not chunk.endswith(b"\n\n"):
            if b"\r\n\r\n" in chunk:
                self.passthrough = True  # not vLLM's framing: leave the stream as it is
                return chunk
            cut = chunk.rfind(b"\n\n") + 2 if b"\n\n" in chunk else 0
            if len(chunk) - cut > _MAX_CARRY:  # an event too long to be the usage event
                head = chunk[:cut]
                if head.find(_USAGE_MARK) >= 0:
                    head = _drop_usage_events(head)
                self.inside, self._newline = True, chunk.endswith(b"\n")
                return head + chunk[cut:]
            chunk, self.carry = chunk[:cut], chunk[cut:]
        if chunk.find(_USAGE_MARK) >= 0:
            # ``find``, not ``in``: the same search, measured about 0.1 us less per read (the
            # containment protocol's overhead), and this runs on every read of most streams.
            chunk = _drop_usage_events(chunk)
        return chunk

    def _through_long_event(self, chunk: bytes) -> bytes:
        """The rest of a long event as it comes, then the stream after it stripped as usual."""
        if self._newline and chunk.startswith(b"\n"):
            end = 1  # the event's blank line began at the end of the last read
        else:
            found = chunk.find(b"\n\n")
            if found < 0:
                self._newline = chunk.endswith(b"\n")
                return chunk
            end = found + 2
        self.inside = False
        rest = chunk[end:]
        return chunk[:end] + (self(rest) if rest else b"")

    def flush(self) -> bytes:
        """What is still held back when the stream ends."""
        carry, self.carry = self.carry, b""
        return carry


def _drop_usage_events(chunk: bytes) -> bytes:
    events = chunk.split(b"\n\n")
    kept = [e for e in events if not (_USAGE_MARK in e and b'"usage"' in e)]
    return b"\n\n".join(kept)
