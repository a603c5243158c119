"""What the proxy's log says of an engine failure: the failure, never the request that met it
(the engine's API key and the client's headers travel in aiohttp's errors)."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.fleet.upstream import loggable, translate

SECRET = "sk-engine-TOPSECRET-42"


def response_error() -> aiohttp.ClientResponseError:
    url = URL("http://127.0.0.1:8001/v1/chat/completions")
    headers = CIMultiDictProxy(CIMultiDict({"Authorization": f"Bearer {SECRET}",
                                            "X-Client": "private"}))  # fmt: skip
    info = aiohttp.RequestInfo(url, "POST", headers, url)
    return aiohttp.ClientResponseError(info, (), status=400, message="Invalid header value char")


def test_the_request_headers_of_a_response_error_stay_out_of_the_log_line() -> None:
    exc = response_error()
    assert SECRET in repr(exc)  # what logging the error as it is would write
    line = loggable(exc)
    assert SECRET not in line and "private" not in line
    assert "ClientResponseError" in line and "400" in line and "Invalid header" in line


def test_an_engine_failure_logs_no_credential(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        error = translate(response_error(), "e0", "first_byte")
    assert "malformed response" in str(error)
    assert caplog.records and all(SECRET not in r.getMessage() for r in caplog.records)


def test_other_errors_are_logged_as_they_are() -> None:
    exc = aiohttp.ServerDisconnectedError()
    assert loggable(exc) == repr(exc)
