"""The access log: one structured line per proxied request, on the logger ``kvproxy.access``.

Rules:
- One line per proxied request (``/v1/chat/completions``, ``/v1/completions``), written once when
  the request has ended, whatever way it ended: answered, shed, degraded, from the cache, the client
  gone (499), the engine failing (502) or too slow (504). The proxy's own endpoints are not logged.
- A line names the tenant, never its API key, and holds no prompt or answer text. Token counts come
  from the engine's ``usage`` when the answer carries one; otherwise they are null, never guessed.
- The client's own text (the model it asked for) is written cut to ``SHOWN_CHARS`` characters,
  with every character that is not printable (controls, line and paragraph separators) written
  as its ``\\uXXXX`` escape: no client can make a line long, or look like two lines to a reader
  that splits on any line break.
- The relay does no parsing for it on the hot path: it keeps references to the last few chunks it
  relayed (the whole body for a plain JSON answer), and they are parsed here, once, after the
  answer has gone out, and only when the access log is on.
- This module decides the fields; the logging library formats them (python-json-logger for JSON,
  a small logfmt formatter). Where the lines go is the operator's choice through the named logger;
  ``kvproxy serve`` sends them to stdout, apart from the process log on stderr.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import IO, Any, Protocol

import orjson
from pythonjsonlogger.orjson import OrjsonFormatter

from proxy.core.config import LogConfig
from proxy.core.pools import SHOWN_CHARS
from proxy.core.usage import Usage

ACCESS_LOGGER = "kvproxy.access"

# The fields of an access line, in the order logfmt writes them.
FIELDS: tuple[str, ...] = (
    "request_id",
    "tenant",
    "method",
    "path",
    "model",
    "pool",
    "engine",
    "priority",
    "stream",
    "status",
    "reason",
    "degraded_from",
    "cache",
    "retries",
    "prompt_tokens",
    "output_tokens",
    "dispatch_s",
    "ttft_s",
    "duration_s",
)

log = logging.getLogger(ACCESS_LOGGER)


class AccessJob(Protocol):
    """What the access log reads from a finished request (``proxy.server.relay.Job``)."""

    request_id: str
    started_at: float
    first_byte_at: float | None
    dispatched_at: float | None
    tenant: str | None
    model: str | None
    asked_pool: str | None
    pool: str
    engine: str
    cls: str
    path: str
    stream: bool
    status: int
    shed_reason: str | None
    extra_headers: dict[str, str]
    retries: int
    usage: Usage | None


def access_fields(job: AccessJob, now: float) -> dict[str, Any]:
    """The access line of ``job``, ended at ``now`` (same clock as ``job.started_at``)."""
    usage = job.usage
    degraded_from = job.asked_pool if job.asked_pool not in (None, job.pool) else None
    ttft = None if job.first_byte_at is None else round(job.first_byte_at - job.started_at, 6)
    sent = job.dispatched_at
    dispatch = None if sent is None else round(sent - job.started_at, 6)
    cached = job.engine == "cache"
    return {
        "request_id": job.request_id,
        "tenant": job.tenant,
        "method": "POST",
        "path": job.path or None,
        "model": None if job.model is None else _clients(job.model),
        "pool": _named(job.pool),
        "engine": _named(job.engine),
        "priority": job.cls,
        "stream": job.stream,
        "status": job.status or 500,
        "reason": job.shed_reason or ("degraded" if degraded_from else None),
        "degraded_from": degraded_from,
        "cache": "HIT" if cached else job.extra_headers.get("X-Cache"),
        "retries": job.retries,
        "prompt_tokens": None if usage is None else usage.prompt,
        "output_tokens": None if usage is None else usage.completion,
        "dispatch_s": dispatch,
        "ttft_s": ttft,
        "duration_s": round(now - job.started_at, 6),
    }


def _clients(text: str) -> str:
    """A client's string as the log writes it (see the rules)."""
    cut = text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS else "")
    if cut.isprintable():
        return cut
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in cut)


def _named(value: str) -> str | None:
    # "none" is the metrics' label for "not decided yet"; the log says null.
    return None if value == "none" else value


def emit(fields: Mapping[str, Any]) -> None:
    """Write one access line (the fields ride on the record; the handler's formatter shapes it)."""
    log.info(
        "%s %s -> %s %s",
        fields["status"],
        fields["model"],
        fields["pool"],
        fields["engine"],
        extra=dict(fields),
    )


# --- formatting and wiring ----------------------------------------------------------------------


def _iso_utc(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, tz=UTC).isoformat()


class _JsonLines(OrjsonFormatter):
    """python-json-logger's orjson formatter with the time first, in ISO 8601 UTC."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _iso_utc(record)


_RENAMED = {"asctime": "time", "levelname": "level", "name": "logger"}


def json_formatter() -> logging.Formatter:
    """JSON lines: time, level, logger, message, and whatever fields the record carries."""
    return _JsonLines("{asctime}{levelname}{name}{message}", style="{", rename_fields=_RENAMED)


def access_json_formatter() -> logging.Formatter:
    """JSON access lines: time and logger, then the access fields (no free-text message)."""
    return _JsonLines("{asctime}{name}", style="{", rename_fields=_RENAMED)


class LogfmtFormatter(logging.Formatter):
    """``time=... logger=kvproxy.access request_id=... status=200 ...``; nulls are left out."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [f"time={self.formatTime(record)}", f"logger={record.name}"]
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                parts.append(f"{name}={_logfmt_value(value)}")
        return " ".join(parts)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _iso_utc(record)  # as the JSON lines write it


def _logfmt_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if text and all(c.isprintable() and c not in ' ="\\' for c in text):
        return text
    return orjson.dumps(text).decode()  # quoted, with JSON's escapes


def access_formatter(fmt: str) -> logging.Formatter:
    return LogfmtFormatter() if fmt == "logfmt" else access_json_formatter()


def install(cfg: LogConfig, stream: IO[str] | None = None) -> logging.Handler | None:
    """Give the access logger its own handler (stdout by default) in ``cfg``'s format.

    The access logger then stops propagating: its lines are data, not the process's log, and
    ``--log-level`` does not silence them (``[log] access`` does). Returns the handler, if any.
    """
    if not cfg.access:
        return None
    handler = logging.StreamHandler(stream if stream is not None else sys.stdout)
    handler.setFormatter(access_formatter(cfg.access_format))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return handler
