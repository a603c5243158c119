"""The check of ``[redis] url``: only a URL that redis-py will turn into working connections.

Rules:
- redis-py checks little when it parses a URL: an unknown query option reaches the connection
  class as a keyword it refuses (``TypeError`` on every connection, not at start-up), a path that
  is not a number is silently database 0, a port that is not a number fails deep in start-up. So
  the proxy accepts only what it knows redis-py's connection class for the scheme takes, and
  refuses the rest at start-up, naming the option.
- Options the proxy sets itself (timeouts, pool size, retries, health checks, the protocol) are
  refused too: in a URL they would silently override ``[redis]`` settings or the replies the proxy
  reads.
- A reason never repeats a value from the URL: it may hold a password.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Callable
from urllib.parse import SplitResult, parse_qsl, urlsplit

from proxy.core.errors import ConfigError

_TRUE_FALSE = {"1", "0", "true", "false", "yes", "no"}
_CERT_REQS = {"none", "optional", "required"}
_TLS_VERSIONS = {v.value for v in ssl.TLSVersion}


def _any_text(value: str) -> bool:
    return True


def _bool(value: str) -> bool:
    return value.lower() in _TRUE_FALSE


def _count(value: str) -> bool:
    return value.isascii() and value.isdigit()


def _tls_version(value: str) -> bool:
    return re.fullmatch(r"-?\d+", value) is not None and int(value) in _TLS_VERSIONS


def _verify_flags(value: str) -> bool:
    # redis-py's own syntax: names of ssl.VerifyFlags, comma-separated, brackets optional.
    names = [n.strip() for n in value.replace("[", "").replace("]", "").split(",")]
    return all(n in ssl.VerifyFlags.__members__ for n in names)


# Query options by scheme, each with the check of its value (redis-py's connection classes:
# AbstractConnection for every scheme, Connection adds TCP's, SSLConnection adds TLS's).
_EVERY: dict[str, Callable[[str], bool]] = {
    "db": _count, "username": _any_text, "password": _any_text, "client_name": _any_text,
    "socket_read_size": lambda v: _count(v) and int(v) > 0,
}  # fmt: skip
_TCP: dict[str, Callable[[str], bool]] = {**_EVERY, "socket_keepalive": _bool}
_TLS: dict[str, Callable[[str], bool]] = {
    **_TCP,
    "ssl_cert_reqs": lambda v: v in _CERT_REQS, "ssl_check_hostname": _bool,
    "ssl_ca_certs": _any_text, "ssl_ca_path": _any_text, "ssl_certfile": _any_text,
    "ssl_keyfile": _any_text, "ssl_password": _any_text, "ssl_ciphers": _any_text,
    "ssl_min_version": _tls_version,
    "ssl_include_verify_flags": _verify_flags, "ssl_exclude_verify_flags": _verify_flags,
}  # fmt: skip
_OPTIONS = {"redis": _TCP, "rediss": _TLS, "unix": _EVERY}
_SET_BY_PROXY = {
    "socket_timeout": "it is redis.op_timeout_s",
    "socket_connect_timeout": "it is redis.connect_timeout_s",
    "max_connections": "it is redis.max_connections",
    "retry_on_timeout": "the proxy never retries a Redis operation",
    "health_check_interval": "the proxy's operations have timeouts of their own",
    "protocol": "the proxy reads RESP2 replies",
    "legacy_responses": "the proxy reads RESP2 replies",
}


def check_redis_url(value: str) -> None:
    """Raise ``ConfigError("url", reason)`` unless redis-py can connect with ``value``."""
    if not value:
        return  # no Redis
    reason = _problem(value)
    if reason is not None:
        raise ConfigError("url", reason)


def _problem(value: str) -> str | None:
    if any(c.isspace() or not c.isprintable() for c in value) or "#" in value:
        return "must not contain white space, control characters or a '#' fragment"
    try:
        parts = urlsplit(value)
        port = parts.port  # raises for a port out of range or not a number
    except ValueError:
        return "is not a valid URL (mind brackets; a port must be a number in 1..65535)"
    if parts.scheme not in _OPTIONS:
        return "must be a redis://, rediss:// or unix:// URL"
    where = _unix_problem(parts) if parts.scheme == "unix" else _tcp_problem(parts, port)
    return where or _query_problem(parts)


def _tcp_problem(parts: SplitResult, port: int | None) -> str | None:
    if not parts.hostname:
        return f"a {parts.scheme}:// URL needs a host"
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        return "a port must be a number in 1..65535"
    if not re.fullmatch(r"(/(\d+)?)?", parts.path):
        return "the path, if any, must be a database number (redis://host:6379/0)"
    if parts.path.strip("/") and "db" in dict(_pairs(parts.query) or []):
        return "the database is given twice (path and ?db=)"
    return None


def _unix_problem(parts: SplitResult) -> str | None:
    if parts.hostname or parts.port is not None or not parts.path.startswith("/"):
        return "a unix:// URL names the socket's absolute path (unix:///run/redis.sock)"
    return None


def _query_problem(parts: SplitResult) -> str | None:
    pairs = _pairs(parts.query)
    if pairs is None:
        return "the query must be name=value pairs joined by '&'"
    known = _OPTIONS[parts.scheme]
    names = [name for name, _ in pairs]
    for name, raw in pairs:
        if name in _SET_BY_PROXY:
            return f"query option {name!r} is not accepted: {_SET_BY_PROXY[name]}"
        if name not in known:
            tls = " (a TLS option: rediss:// only)" if name in _TLS else ""
            return f"unknown query option {name!r} for a {parts.scheme}:// URL{tls}"
        if names.count(name) > 1:
            return f"query option {name!r} is given twice"
        if not raw or not known[name](raw):
            return f"query option {name!r} has an invalid value"
    return None


def _pairs(query: str) -> list[tuple[str, str]] | None:
    try:
        return parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError:
        return None
