"""The small checks every configuration section makes of its own fields.

Rules: pure and shared by the modules that define sections (``config``, ``fleet_config``,
``kv_config``); a failed check raises ``ConfigError`` naming the field as its section knows it,
and the loader places that name under its dotted path (``pools[0].engines[1].url``).
"""

from __future__ import annotations

from proxy.core.errors import ConfigError


def require(ok: bool, name: str, message: str) -> None:
    """Raise ``ConfigError(name, message)`` unless ``ok``."""
    if not ok:
        raise ConfigError(name, message)


def positive(obj: object, *names: str) -> None:
    """Each named attribute of ``obj`` must be > 0."""
    for name in names:
        require(getattr(obj, name) > 0, name, "must be > 0")


def http_url(value: str) -> bool:
    """Whether ``value`` is an http(s) URL with something after the scheme."""
    return value.startswith(("http://", "https://")) and len(value.split("://", 1)[1]) > 0
