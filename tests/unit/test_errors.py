import orjson
import pytest

from proxy.core.errors import (
    BadRequest,
    ClientError,
    ConfigError,
    KvproxyError,
    NoCapacity,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
    UpstreamError,
    UpstreamTimeout,
)


@pytest.mark.parametrize(
    ("error", "status", "err_type"),
    [
        (BadRequest("bad", param="messages"), 400, "invalid_request_error"),
        (NotFound("no such model", param="model"), 404, "invalid_request_error"),
        (PayloadTooLarge("too big"), 413, "invalid_request_error"),
        (Unauthorized("who are you"), 401, "authentication_error"),
        (RateLimited("slow down", retry_after_s=3), 429, "rate_limit_error"),
        (NoCapacity("full", reason="kv_pressure"), 503, "overloaded"),
        (UpstreamError("engine broke"), 502, "upstream_error"),
        (UpstreamTimeout("engine slow"), 504, "timeout"),
    ],
)
def test_status_and_type(error: KvproxyError, status: int, err_type: str) -> None:
    assert error.status == status
    doc = orjson.loads(error.body())
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["type"] == err_type
    assert doc["error"]["message"] == str(error)


def test_hierarchy_by_fault() -> None:
    assert issubclass(BadRequest, ClientError)
    assert issubclass(RateLimited, ClientError)
    assert issubclass(UpstreamTimeout, UpstreamError)
    assert not issubclass(NoCapacity, ClientError)
    assert not issubclass(ConfigError, KvproxyError)


def test_param_and_code() -> None:
    doc = orjson.loads(NotFound("x", param="model").body())["error"]
    assert doc["param"] == "model"
    assert doc["code"] == "model_not_found"
    assert orjson.loads(BadRequest("x", code="c").body())["error"]["code"] == "c"


def test_no_capacity_headers() -> None:
    err = NoCapacity("busy", reason="kv_pressure", retry_after_s=2.2)
    assert err.reason == "kv_pressure"
    assert err.headers() == {"Retry-After": "3", "X-Kvproxy-Shed-Reason": "kv_pressure"}
    # Never "retry after 0 s".
    assert NoCapacity("x", reason="r", retry_after_s=0).headers()["Retry-After"] == "1"


def test_rate_limited_headers() -> None:
    assert RateLimited("x", retry_after_s=5).headers() == {"Retry-After": "5"}
    assert BadRequest("x").headers() == {}


def test_config_error_paths() -> None:
    err = ConfigError("url", "must be an http(s) URL").under("pools[0].engines[1]")
    assert err.field == "pools[0].engines[1].url"
    assert str(err) == "pools[0].engines[1].url: must be an http(s) URL"
    assert ConfigError("[2].name", "dup").under("pools").field == "pools[2].name"
    assert ConfigError("", "broken").under("server").field == "server"
