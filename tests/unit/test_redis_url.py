"""``[redis] url`` is checked at start-up: only URLs redis-py turns into working connections.

redis-py itself refuses little when it parses a URL: an unknown query option became a TypeError on
every connection (a log flood, and 500s from the cache), a port that is not a number a traceback.
"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from proxy.cli import EXIT_CONFIG, main
from proxy.core.configload import load_config
from proxy.core.door_config import RedisConfig
from proxy.core.errors import ConfigError

GOOD = [
    "",  # no Redis
    "redis://127.0.0.1:6379/0",
    "redis://redis",
    "redis://redis:6379/",
    "redis://:s3cret@redis:6379/2",
    "redis://user:p%40ss@redis/5",
    "redis://[::1]:6379/0?client_name=kvproxy&socket_keepalive=yes",
    "redis://redis?db=3&socket_read_size=65536",
    "rediss://redis.example:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"
    "&ssl_check_hostname=false&ssl_min_version=771"
    "&ssl_include_verify_flags=VERIFY_X509_STRICT,VERIFY_X509_PARTIAL_CHAIN",
    "rediss://:pw@redis.example:6380/1?ssl_certfile=/c.pem&ssl_keyfile=/k.pem&ssl_cert_reqs=none",
    "unix:///run/redis/redis.sock",
    "unix:///run/redis/redis.sock?db=1&password=s3cret",
    "unix://:s3cret@/run/redis/redis.sock",
]

BAD = [
    ("redis://127.0.0.1:6379/0?socket_timeot=1", "unknown query option 'socket_timeot'"),
    ("redis://127.0.0.1:notaport", "port must be a number"),
    ("redis://127.0.0.1:70000", "port must be a number"),
    ("redis://127.0.0.1:0", "port must be a number"),
    ("redis://127.0.0.1:", "port must be a number"),
    ("redis://[::1:6379", "not a valid URL"),
    ("http://redis:6379", "redis://, rediss:// or unix://"),
    ("redis://", "needs a host"),
    ("redis:///0", "needs a host"),
    ("redis://redis/zero", "database number"),
    ("redis://redis/1/2", "database number"),
    ("redis://redis/0?db=1", "database is given twice"),
    ("redis://redis?db=-1", "'db' has an invalid value"),
    ("redis://redis?db=", "'db' has an invalid value"),
    ("redis://redis?db=1&db=2", "'db' is given twice"),
    ("redis://redis?db", "name=value pairs"),
    ("redis://redis?timeout=1", "unknown query option 'timeout'"),
    ("redis://redis?ssl_ca_certs=/ca.pem", "rediss:// only"),
    ("redis://redis?socket_timeout=1", "redis.op_timeout_s"),
    ("redis://redis?socket_connect_timeout=1", "redis.connect_timeout_s"),
    ("redis://redis?max_connections=5", "redis.max_connections"),
    ("redis://redis?retry_on_timeout=yes", "never retries"),
    ("redis://redis?protocol=3", "RESP2"),
    ("redis://redis?socket_keepalive=ture", "'socket_keepalive' has an invalid value"),
    ("rediss://redis?ssl_cert_reqs=maybe", "'ssl_cert_reqs' has an invalid value"),
    ("rediss://redis?ssl_min_version=5", "'ssl_min_version' has an invalid value"),
    ("rediss://redis?ssl_include_verify_flags=VERIFY_NOTHING", "has an invalid value"),
    ("unix://run/redis.sock", "absolute path"),
    ("unix:///run/redis.sock?socket_keepalive=1", "unknown query option 'socket_keepalive'"),
    ("redis://redis:6379/0#x", "fragment"),
    ("redis://redis :6379/0", "white space"),
]


@pytest.mark.parametrize(("url", "reason"), BAD)
def test_a_url_redis_py_would_not_accept_is_refused_naming_the_field(url: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {}, [f"redis.url={url}"])
    assert info.value.field == "redis.url"
    assert str(info.value).startswith("redis.url: ")
    assert reason in info.value.reason


@pytest.mark.parametrize("url", GOOD)
async def test_a_good_url_is_accepted_and_makes_connections(url: str) -> None:
    # The config takes it, and redis-py builds a connection from it the way RedisLink asks
    # (making a connection object connects nothing: this is where an unknown option failed).
    assert load_config(None, {}, [f"redis.url={url}"]).redis.url == url
    if url:
        client = aioredis.Redis.from_url(url, socket_timeout=0.25, max_connections=4)
        try:
            client.connection_pool.make_connection()
        finally:
            await client.aclose()


def test_the_reason_never_repeats_the_password() -> None:
    for url in ("redis://:hunter2secret@redis:6379/0?nosuch=1",
                "redis://u:hunter2secret@redis:notaport/0",
                "unix:///run/r.sock?password=hunter2secret&password=hunter2secret"):  # fmt: skip
        with pytest.raises(ConfigError) as info:
            RedisConfig(url=url)
        assert "hunter2secret" not in str(info.value)


def test_a_bad_url_stops_serve_with_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--set", "redis.url=redis://:hunter2secret@127.0.0.1:notaport"]) == (
        EXIT_CONFIG
    )
    err = capsys.readouterr().err
    assert err.startswith("kvproxy: configuration error: redis.url: ")
    assert err.count("\n") == 1 and "hunter2secret" not in err
