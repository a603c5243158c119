"""What every figure is stamped with: the machine, the versions, the command, the time.

Rules: read from the system (``/proc/cpuinfo``, ``os``, package metadata), never typed in; a value
that cannot be read is reported as ``"unknown"``, never guessed.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

import orjson


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def environment() -> dict[str, object]:
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "memory_gib": _mem_gib(),
        "load_avg_at_start": list(os.getloadavg()),
    }


def _mem_gib() -> float | str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return "unknown"


def own_versions() -> dict[str, str]:
    return {name: _version(name) for name in ("kvproxy", "aiohttp", "uvloop", "orjson")}


def command_line() -> str:
    return shlex.join([Path(sys.executable).name, "-m", _module_name(), *sys.argv[1:]])


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def read_json(path: Path) -> dict[str, object]:
    data = orjson.loads(path.read_bytes())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def core_times() -> dict[str, tuple[int, int]]:
    """Per core, (busy, total) clock ticks since boot from ``/proc/stat`` (idle and I/O wait
    are not busy); empty where it cannot be read."""
    out: dict[str, tuple[int, int]] = {}
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu" and len(fields) >= 5:
            ticks = [int(f) for f in fields]
            out[name] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return out


def cores_busy(before: dict[str, tuple[int, int]],
               after: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Each core's busy fraction between two ``core_times`` readings."""
    out = {}
    for name, (busy, total) in after.items():
        b0, t0 = before.get(name, (busy, total))
        if total > t0:
            out[name] = (busy - b0) / (total - t0)
    return out


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped because a listening socket's accept queue was
    full (``TcpExt ListenOverflows``, machine-wide); None where it cannot be read. A dropped
    connection completes only when the client retransmits, a first token late by 0.2-1 s."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            found = row.get("ListenOverflows")
            return int(found) if found is not None and found.isdigit() else None
    return None
