"""Recording an engine's answer for the cache: what the relay tells a recorder, and the complete
answer rebuilt from it in the non-streamed shape an entry (``proxy.core.cache_entry``) stores.

Rules (pure, no I/O):
- Only normally completed answers are recorded: a JSON answer with every choice finished, or an
  SSE stream that ended with ``data: [DONE]`` after every choice reported a ``finish_reason``. A
  stream that broke off, carried an error event, or had a choice finish with ``abort`` never is.
- Stream deltas are merged field by field (strings concatenate). A delta this module cannot
  merge faithfully (tool-call fragments, per-token logprobs) makes the answer unstorable rather
  than wrong, and so does any other field with a value that the stored answer would drop: an
  event's own beyond the head, the choices and the usage (vLLM's ``prompt_token_ids``,
  ``prompt_text``), a choice's beyond its index, text, finish and stop reason (``token_ids``).
- An answer longer than ``max_bytes`` is never stored: the relay feeds at most that many bytes and
  only counts the rest (``Recorder.skipped``). Bytes after ``[DONE]`` make a stream unstorable.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Protocol

import orjson

from proxy.core.cache_entry import ANSWER_FIELDS, HEAD_FIELDS, is_finished, set_beyond
from proxy.core.token_runs import find_run


def complete_json(body: bytes) -> dict[str, Any] | None:
    """The parsed answer if ``body`` is a normally completed non-streamed response, else None."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or "error" in doc or not is_finished(doc):
        return None
    return doc


class StreamAssembler:
    """Rebuilds the non-streamed answer from SSE bytes, in one pass over them.

    Fed the whole stream at once (the relay's case) or piece by piece (CRLF and events may be split
    anywhere): only complete events are parsed, each once, and strings are joined once at the end,
    so the cost is linear in the stream's size."""

    def __init__(self, *, chat: bool, max_bytes: int) -> None:
        self._chat = chat
        self._max_bytes = max_bytes
        self._seen = 0
        self._buffer = b""
        self._head: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: object = None
        self.done = False
        self.storable = True

    def feed(self, data: bytes) -> None:
        if not self.storable:
            return
        self._seen += len(data)
        if self._seen > self._max_bytes or self.done:
            # Too big to store, or bytes after [DONE]: either way not an answer to keep.
            self._give_up()
            return
        buffer = self._buffer + data
        if b"\r" in buffer:
            # Normalised on the whole remainder: a CRLF may be split across two reads. Checked
            # first: most engines send bare LFs, and the replace is a scan and a copy.
            buffer = buffer.replace(b"\r\n", b"\n")
        end = buffer.rfind(b"\n\n")
        self._buffer = buffer[end + 2 :] if end >= 0 else buffer  # an event not yet ended
        if end >= 0:
            self._complete(buffer[: end + 2])

    def _complete(self, events: bytes) -> None:
        """Complete events, in order: the run of token events that makes up most of an answer
        taken whole (``token_runs``: its texts decoded at once), the rest parsed one by one."""
        run = find_run(events, chat=self._chat)
        if run is None:
            self._parse(events)
            return
        self._parse(events[: run.first_end])  # up to the run's first event: head, choice, text
        if not self.storable:
            return
        into = self._choices.get(0)
        pieces = None if into is None else into.fields.get("content" if self._chat else "text")
        if pieces is None:  # not reachable after the run's first event; parsed one by one then
            self._parse(events[run.first_end :])
            return
        pieces.append(run.text)  # the same as one piece per event: they are joined once
        self._parse(run.tail)

    def _parse(self, events: bytes) -> None:
        """Complete events (ending with a blank line) parsed one by one."""
        if events:
            # Split on single LFs: a one-byte split is several times cheaper than on b"\n\n",
            # and blank lines still mark where events end.
            self._lines(events[:-2].split(b"\n"))

    def _lines(self, lines: list[bytes]) -> None:
        """Complete events' lines, in order; a blank line ends an event."""
        data_lines = lines[::2]
        if not any(lines[1::2]) and all(map(bytes.startswith, data_lines, repeat(b"data:"))):
            # The usual stream, each event one data line: line, blank, line... checked and cut
            # by C loops, not a Python step per line.
            self._events([line[5:] for line in data_lines])
            return
        payloads: list[bytes] = []
        data: list[bytes] = []
        for line in lines:
            if line:
                if line.startswith(b"data:"):
                    data.append(line)
                continue  # comments (keep-alives) and other fields
            if data:
                payloads.append(_payload(data))
                data = []
        if data:
            payloads.append(_payload(data))
        self._events(payloads)

    def _give_up(self) -> None:
        self.storable = False
        self._buffer = b""
        self._choices.clear()

    def _events(self, payloads: list[bytes]) -> None:
        """Each event's data in order. One loop for all of them, not calls per event: this runs
        once per streamed token of every answer the cache may store."""
        loads, merge = orjson.loads, self._merge
        for data in payloads:
            if self.done:
                self._give_up()  # an event after [DONE]
                return
            if data[:2] != b" {" and data.strip() == b"[DONE]":
                self.done = True
                continue
            try:
                obj = loads(data)  # JSON takes a leading space: no copy of the payload
            except orjson.JSONDecodeError:
                obj = None
            if (not isinstance(obj, dict) or "error" in obj
                    or not isinstance(choices := obj.get("choices"), list)):
                self._give_up()
                return
            if set_beyond(obj, ANSWER_FIELDS):
                self._give_up()  # a field the stored answer would drop (token ids, say)
                return
            if not self._head:
                self._head = {k: obj[k] for k in HEAD_FIELDS if k in obj}
            if obj.get("usage"):
                self._usage = obj["usage"]
            # vLLM writes the fingerprint on a stream's last chunk, not its first.
            if (fingerprint := obj.get("system_fingerprint")) is not None:
                self._head["system_fingerprint"] = fingerprint
            for choice in choices:
                if type(choice) is dict and self._token(choice):
                    continue
                if not (isinstance(choice, dict) and merge(choice)):
                    self._give_up()
                    return

    def _token(self, choice: dict[str, Any]) -> bool:
        """The usual streamed event, one choice's next text and nothing else, appended to the
        text's pieces; False for anything else (``_merge`` then takes it, fully checked)."""
        if len(choice) != 4:
            return False
        try:  # with the text's key, exactly these four: nothing else to merge
            index, finish, logprobs = choice["index"], choice["finish_reason"], choice["logprobs"]
        except KeyError:
            return False
        if finish is not None or logprobs is not None or type(index) is not int:
            return False
        key = "content" if self._chat else "text"
        delta = choice.get("delta") if self._chat else choice
        if type(delta) is not dict or (self._chat and len(delta) != 1):
            return False
        text, into = delta.get(key), self._choices.get(index)
        if type(text) is not str or into is None or (pieces := into.fields.get(key)) is None:
            return False
        pieces.append(text)
        return True

    def _merge(self, choice: dict[str, Any]) -> bool:
        index = choice.get("index", 0)
        if not isinstance(index, int) or choice.get("logprobs") is not None:
            return False
        if set_beyond(choice, _CHOICE_FIELDS):
            return False
        into = self._choices.get(index)
        if into is None:
            into = self._choices[index] = _Choice(index)
        if choice.get("finish_reason") is not None:
            into.finish_reason = choice["finish_reason"]
        if "stop_reason" in choice:
            into.stop_reason = choice["stop_reason"]
            into.has_stop_reason = True
        if self._chat:
            delta = choice.get("delta") or {}
            return isinstance(delta, dict) and into.merge(delta)
        return into.merge({"text": choice.get("text") or ""})

    def result(self) -> dict[str, Any] | None:
        """The complete answer, or None if the stream did not end normally."""
        if not (self.done and self.storable and self._choices) or self._buffer.strip():
            return None
        choices = [self._choices[i].render(self._chat) for i in sorted(self._choices)]
        response = {**self._head, "object": "chat.completion" if self._chat else "text_completion"}
        response["choices"] = choices
        response["usage"] = self._usage
        return response if is_finished(response) else None


# What a streamed choice may carry with a value (an event: ``ANSWER_FIELDS``): anything else
# would be lost.
_CHOICE_FIELDS = frozenset({"index", "delta", "text", "logprobs", "finish_reason", "stop_reason"})


def _payload(lines: list[bytes]) -> bytes:
    """An event's data from its data lines (at least one). The usual event is one data line: its
    payload is taken as it is, leading space and all."""
    if len(lines) == 1:
        return lines[0][5:]
    return b"\n".join(ln[5:].lstrip(b" ") for ln in lines)


class _Choice:
    """One choice being assembled: string fields kept as their pieces, joined once."""

    __slots__ = ("fields", "finish_reason", "has_stop_reason", "index", "stop_reason")

    def __init__(self, index: int) -> None:
        self.index = index
        self.finish_reason: object = None
        self.stop_reason: object = None
        self.has_stop_reason = False
        # Field name -> its string pieces in order; ``role`` (replaced, not joined) -> [value].
        self.fields: dict[str, list[Any]] = {}

    def merge(self, delta: dict[str, Any]) -> bool:
        """Strings concatenate, ``role`` is replaced; anything else (tool-call fragments and the
        like) is not merged faithfully, so the answer is not stored (False)."""
        fields = self.fields
        for key, value in delta.items():
            if value is None:
                continue
            if key == "role":
                fields["role"] = [value]
            elif isinstance(value, str):
                pieces = fields.get(key)
                if pieces is None:
                    fields[key] = [value]
                else:
                    pieces.append(value)
            elif value in ([], {}):
                continue
            else:
                return False
        return True

    def render(self, chat: bool) -> dict[str, Any]:
        joined = {k: v[0] if k == "role" else "".join(v) for k, v in self.fields.items()}
        out: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason}
        if chat:
            joined.setdefault("role", "assistant")
            joined.setdefault("content", "")
            out["message"] = joined
        else:
            out.update(joined)
        if self.has_stop_reason:
            out["stop_reason"] = self.stop_reason
        out["logprobs"] = None
        return out


class Recorder(Protocol):
    """What the relay tells a recorder: the engine's status and shape, then every byte the engine
    sent (the final usage event included, even when it is stripped from the client's stream). A
    stream's bytes are told once, when it has ended: the first ``max_bytes`` of them with ``feed``
    and, for a longer answer, only their count with ``skipped``."""

    @property
    def max_bytes(self) -> int:
        """Bytes of an answer worth keeping: a longer one is never stored."""
        ...

    def start(self, status: int, *, streamed: bool) -> None: ...

    def feed(self, data: bytes) -> None: ...

    def skipped(self, size: int) -> None:
        """``size`` more bytes were relayed but not kept (past ``max_bytes``)."""
        ...


class Recording:
    """What the relay passed to the client for one request, and the answer if it completed."""

    def __init__(self, *, chat: bool, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._chat = chat
        # Made when the stream's bytes come (once, at its end): until then an open stream holds
        # one object fewer for the garbage collector to scan.
        self._assembler: StreamAssembler | None = None
        self._body = bytearray()
        self.status = 0
        self.streamed: bool | None = None
        self.bytes_seen = 0
        self._skipped = False

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def start(self, status: int, *, streamed: bool) -> None:
        """The engine answered with ``status``; ``streamed``: its body is SSE."""
        self.status = status
        self.streamed = streamed

    def feed(self, data: bytes) -> None:
        """The engine's bytes in order, as relayed to the client except that a usage event the
        proxy asked for on the client's behalf is seen here though the client never gets it."""
        self.bytes_seen += len(data)
        if self.status != 200 or self.streamed is None:
            return
        if self.streamed:
            self._assembled().feed(data)
        elif len(self._body) <= self._max_bytes:
            self._body += data

    def skipped(self, size: int) -> None:
        """Bytes relayed but not kept: counted, and the answer is too long to store."""
        self.bytes_seen += size
        self._skipped = True

    @property
    def overflowed(self) -> bool:
        """Whether bytes were relayed past ``max_bytes`` (``skipped``): too long to store."""
        return self._skipped

    def response(self) -> dict[str, Any] | None:
        """The complete answer in the non-streamed shape, or None."""
        if self.status != 200 or self.streamed is None or self._skipped:
            return None
        return self._assembled().result() if self.streamed else complete_json(bytes(self._body))

    def _assembled(self) -> StreamAssembler:
        if self._assembler is None:
            self._assembler = StreamAssembler(chat=self._chat, max_bytes=self._max_bytes)
        return self._assembler
