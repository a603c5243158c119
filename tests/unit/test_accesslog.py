"""The access log's pure parts: usage read from relayed bytes, the fields of a line, formats."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import orjson
import pytest

from proxy.core.config import LogConfig
from proxy.core.configload import load_config
from proxy.core.errors import ConfigError
from proxy.core.usage import Usage
from proxy.observe import accesslog
from proxy.observe.accesslog import access_fields
from proxy.server.job import Job


def _job(**kw: object) -> Job:
    job = Job("rid-1", 100.0, cls="standard", path="/v1/chat/completions")
    for key, value in kw.items():
        setattr(job, key, value)
    return job


def test_fields_of_a_request_served_by_the_pool_it_asked_for() -> None:
    job = _job(
        tenant="acme", model="m", pool="target", asked_pool="target", engine="t0", status=200,
        first_byte_at=100.25, retries=1, usage=Usage(12, 5),
        extra_headers={"X-Cache": "MISS"},
    )  # fmt: skip
    fields = access_fields(job, now=101.5)
    assert set(fields) == set(accesslog.FIELDS)
    assert fields["request_id"] == "rid-1" and fields["tenant"] == "acme"
    assert (fields["pool"], fields["engine"], fields["status"]) == ("target", "t0", 200)
    assert (fields["reason"], fields["degraded_from"], fields["cache"]) == (None, None, "MISS")
    assert (fields["prompt_tokens"], fields["output_tokens"], fields["retries"]) == (12, 5, 1)
    assert (fields["ttft_s"], fields["duration_s"]) == (0.25, 1.5)


def test_fields_of_a_degraded_a_shed_and_an_unfinished_request() -> None:
    degraded = access_fields(_job(pool="draft", asked_pool="target", status=200), now=100.0)
    assert (degraded["reason"], degraded["degraded_from"]) == ("degraded", "target")
    shed = access_fields(
        _job(pool="target", asked_pool="target", status=503, shed_reason="kv_pressure"), now=100.0
    )
    assert (shed["reason"], shed["degraded_from"], shed["engine"]) == ("kv_pressure", None, None)
    # Failed before any decision (a bad body): nothing decided is null, the status is kept.
    early = access_fields(_job(status=400), now=100.0)
    assert (early["pool"], early["engine"], early["tenant"], early["model"]) == (None,) * 4
    assert (early["status"], early["ttft_s"], early["cache"]) == (400, None, None)


def test_a_cache_hit_says_so_whatever_the_header_said() -> None:
    job = _job(engine="cache", status=200, extra_headers={"X-Cache": "MISS"})
    assert access_fields(job, now=100.0)["cache"] == "HIT"


def test_log_config_is_validated_with_the_field_name() -> None:
    assert load_config(None, {}, ["log.access=true"]).log == LogConfig(access=True)
    env = {"KVPROXY_LOG_ACCESS_FORMAT": "logfmt"}
    assert load_config(None, env, []).log.access_format == "logfmt"
    with pytest.raises(ConfigError, match=r"log\.access_format"):
        load_config(None, {}, ["log.access_format=xml"])


@pytest.fixture
def access_logger() -> Iterator[logging.Logger]:
    """The access logger, restored after ``install`` gave it a handler."""
    logger = logging.getLogger(accesslog.ACCESS_LOGGER)
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


LINE = {
    "request_id": "r 1", "tenant": "acme", "method": "POST", "path": "/v1/completions",
    "model": "m", "pool": "target", "engine": "t0", "priority": "standard", "stream": True,
    "status": 200, "reason": None, "degraded_from": None, "cache": "BYPASS", "retries": 0,
    "prompt_tokens": 3, "output_tokens": None, "ttft_s": 0.01, "duration_s": 0.02,
}  # fmt: skip


def test_installed_json_lines_are_json_with_every_field(access_logger: logging.Logger) -> None:
    out = io.StringIO()
    accesslog.install(LogConfig(access=True), out)
    accesslog.emit(LINE)
    doc = orjson.loads(out.getvalue())
    assert {k: doc[k] for k in LINE} == LINE
    assert doc["logger"] == "kvproxy.access" and "time" in doc and "message" not in doc
    assert access_logger.propagate is False  # its lines are not the process log's


def test_installed_logfmt_lines_quote_what_needs_it(access_logger: logging.Logger) -> None:
    out = io.StringIO()
    accesslog.install(LogConfig(access=True, access_format="logfmt"), out)
    accesslog.emit(LINE)
    line = out.getvalue().strip()
    assert line.startswith("time=") and " logger=kvproxy.access " in line
    assert ' request_id="r 1" ' in line and " stream=true " in line and " status=200 " in line
    assert "output_tokens" not in line and "reason" not in line  # nulls are left out


def test_install_does_nothing_when_the_access_log_is_off(access_logger: logging.Logger) -> None:
    before = access_logger.handlers[:]
    assert accesslog.install(LogConfig(access=False), io.StringIO()) is None
    assert access_logger.handlers == before


def test_the_access_log_is_not_silenced_by_the_process_log_level(
    access_logger: logging.Logger,
) -> None:
    out = io.StringIO()
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        accesslog.install(LogConfig(access=True), out)
        accesslog.emit(LINE)
    finally:
        root.setLevel(level)
    assert out.getvalue()


@pytest.mark.parametrize("fmt", ["json", "logfmt"])
def test_a_clients_model_name_is_one_short_line_whatever_it_holds(
    access_logger: logging.Logger, fmt: str
) -> None:
    out = io.StringIO()
    accesslog.install(LogConfig(access=True, access_format=fmt), out)
    forged = "m\u0085request_id=FORGED status=200\u2028\u009b" + "x" * 10_000
    fields = access_fields(_job(model=forged, status=404), 101.0)
    accesslog.emit(fields)
    line = out.getvalue()
    assert len(line.splitlines()) == 1 and len(line) < 1000
    assert fields["model"].startswith("m\\u0085request_id=FORGED status=200\\u2028\\u009bxxx")
    assert fields["model"].endswith("...")
    assert access_fields(_job(model="gpt-4o"), 101.0)["model"] == "gpt-4o"
