"""Loading the configuration: one TOML file, then environment variables, then ``--set`` overrides,
turned into the frozen config dataclasses with dotted error paths.

Rules:
- Sources apply in order: TOML file, ``KVPROXY_<SECTION>_<KEY>`` environment variables, then
  ``--set section.key=value`` overrides. Environment variables and overrides reach scalar settings
  of the sections (nested tables included, e.g. ``admission.sheddable.shed_above``); pools and
  aliases are lists and are set in TOML only.
- Unknown keys are errors, so a typo never passes silently. Every error is a ``ConfigError`` whose
  ``field`` is the dotted path of the bad setting, e.g. ``pools[0].engines[1].url``.
- This module reads the file it is given and nothing else; it never looks at ``os.environ`` itself.
- Types come from the dataclasses' annotations: ``bool``, ``int``, ``float``, ``str``, ``X | None``,
  ``tuple[X, ...]`` and nested dataclasses. Anything else in an annotation is a programming error.
- An ``int`` is accepted where a ``float`` is expected; a ``bool`` is never accepted as a number;
  ``inf`` and ``nan`` are never accepted (no setting has a use for them).
- A nested table that is given only in part keeps the defaults of the keys it leaves out.
- Missing required keys are ``ConfigError`` naming the dotted field too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from proxy.core.config import Config
from proxy.core.errors import ConfigError

T = TypeVar("T")
ENV_PREFIX = "KVPROXY_"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def build(cls: type[T], data: object, path: str, base: T | None = None) -> T:
    """Build dataclass ``cls`` from the dict ``data``; missing keys come from ``base``/defaults."""
    if not isinstance(data, dict):
        raise ConfigError(path, "must be a table")
    hints = _hints(cls)
    # Fields set by the class itself (``init=False``: derived state) are no settings.
    settings = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    names = {f.name for f in settings}
    for key in data:
        if key not in names:
            raise ConfigError(_join(path, str(key)), "unknown key")
    kwargs: dict[str, Any] = {}
    for f in settings:
        where = _join(path, f.name)
        current = getattr(base, f.name) if base is not None else _default(f)
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], where, current)
        elif current is not dataclasses.MISSING:
            kwargs[f.name] = current
        else:
            raise ConfigError(where, "is required")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.under(path) from None


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _convert(tp: Any, value: object, path: str, current: Any = None) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        base = current if dataclasses.is_dataclass(current) else None
        return build(tp, value, path, base)
    if origin is tuple:
        return _convert_tuple(typing.get_args(tp)[0], value, path)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner[0], value, path)
    return _convert_scalar(tp, value, path)


def _convert_tuple(item_tp: Any, value: object, path: str) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise ConfigError(path, "must be an array")
    return tuple(_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))


def _convert_scalar(tp: Any, value: object, path: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, "must be a boolean")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, "must be an integer")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            # No setting takes an infinite or undefined value (TOML, the environment and
            # ``--set`` can all spell one): refused here, once, whatever the field's own range.
            if not math.isfinite(value):
                raise ConfigError(path, "must be a finite number")
            return float(value)
        raise ConfigError(path, "must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, "must be a string")
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")


def scalar_paths(cls: type, sections: Iterable[str]) -> dict[str, type]:
    """Dotted paths of every scalar setting under ``sections`` of ``cls``, with their types."""
    hints = _hints(cls)
    out: dict[str, type] = {}
    for section in sections:
        _collect(hints[section], section, out)
    return out


def _collect(tp: Any, path: str, out: dict[str, type]) -> None:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        for name, sub in _hints(tp).items():
            _collect(sub, f"{path}.{name}", out)
        return
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp in (bool, int, float, str):
        out[path] = tp


def parse_scalar(raw: str, tp: type, path: str) -> object:
    """Parse the text of an environment variable or ``--set`` value into ``tp``."""
    text = raw.strip()
    try:
        if tp is bool:
            return _parse_bool(text, path)
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        raise ConfigError(path, f"cannot read {raw!r} as {tp.__name__}") from None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    return text


def _parse_bool(text: str, path: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(path, f"cannot read {text!r} as bool (true/false)")


def set_path(data: dict[str, Any], dotted: str, value: object) -> None:
    """Set ``a.b.c`` in nested dicts, creating tables on the way."""
    *parents, last = dotted.split(".")
    node: Any = data
    walked = ""
    for key in parents:
        walked = _join(walked, key)
        node = node.setdefault(key, {})
        if not isinstance(node, Mapping):
            raise ConfigError(walked, "must be a table")
    node[last] = value


# --- loading -------------------------------------------------------------------------------------

SCALAR_SECTIONS: tuple[str, ...] = (
    "server",
    "telemetry",
    "routing",
    "admission",
    "pressure",
    "upstream",
    "breaker",
    "outlier",
    "auth",
    "cache",
    "redis",
    "limits",
    "log",
    "sharing",
    "kv_events",
)


def load_config(path: str | None, env: Mapping[str, str], overrides: Sequence[str]) -> Config:
    """Read ``path`` (if any), apply ``env`` and ``overrides`` and validate the result."""
    data: dict[str, Any] = _read_toml(path) if path else {}
    paths = scalar_paths(Config, SCALAR_SECTIONS)
    for dotted, raw in _env_settings(env, paths):
        set_path(data, dotted, parse_scalar(raw, paths[dotted], dotted))
    for item in overrides:
        dotted, raw = _split_override(item)
        if dotted not in paths:
            raise ConfigError(dotted, "unknown setting (use --set section.key=value)")
        set_path(data, dotted, parse_scalar(raw, paths[dotted], dotted))
    return build(Config, data, "")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            # A FIFO would block the start-up in open(); a directory is no file either.
            raise ConfigError("", f"{path}: not a regular file")
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("", f"config file not found: {path}") from None
    except PermissionError:
        raise ConfigError("", f"{path}: cannot be read (permission denied)") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError("", f"{path}: invalid TOML: nested too deeply") from None


def _env_settings(env: Mapping[str, str], paths: Mapping[str, type]) -> list[tuple[str, str]]:
    by_env = {ENV_PREFIX + p.replace(".", "_").upper(): p for p in paths}
    sections = {ENV_PREFIX + s.upper() + "_" for s in SCALAR_SECTIONS}
    found: list[tuple[str, str]] = []
    for name in sorted(env):
        if name in by_env:
            found.append((by_env[name], env[name]))
        elif any(name.startswith(s) for s in sections):
            # KVPROXY_<SECTION>_... with a section we own: a typo, not someone else's variable.
            raise ConfigError(name, "unknown environment setting")
    return found


def _split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(item, "override must look like section.key=value")
    return key, value.strip()
