"""The small checks every configuration section makes of its own fields.

Rules: pure and shared by the modules that define sections (``config``, ``fleet_config``,
``kv_config``); a failed check raises ``ConfigError`` naming the field as its section knows it,
and the loader places that name under its dotted path (``pools[0].engines[1].url``).
"""

from __future__ import annotations

import math
from urllib.parse import urlsplit

from proxy.core.errors import ConfigError


def require(ok: bool, name: str, message: str) -> None:
    """Raise ``ConfigError(name, message)`` unless ``ok``."""
    if not ok:
        raise ConfigError(name, message)


def positive(obj: object, *names: str) -> None:
    """Each named attribute of ``obj`` must be a finite number > 0 (an infinite timeout or
    size is not a setting any part of the proxy can use: it fails where it is used)."""
    for name in names:
        value = getattr(obj, name)
        require(value > 0 and math.isfinite(value), name, "must be a finite number > 0")


def at_least_zero(obj: object, *names: str) -> None:
    """Each named attribute of ``obj`` must be a finite number >= 0 (None: not set, allowed)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            require(value >= 0 and math.isfinite(value), name, "must be a finite number >= 0")


def http_url(value: str) -> bool:
    """Whether ``value`` is an http(s) URL of a host and a valid port (a path is allowed: an
    engine may sit behind a prefix); no credentials, query, fragment or white space."""
    if not value.startswith(("http://", "https://")) or any(c.isspace() for c in value):
        return False
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  (raises for a port out of range or not a number)
    except ValueError:
        return False
    return bool(parts.hostname) and not (parts.username or parts.password or parts.query
                                         or parts.fragment or "#" in value or "?" in value)
