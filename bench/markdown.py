"""Markdown helpers shared by the reports: number formatting, tables, the provenance stamp.

Rules: formatting only; a missing or NaN value renders as ``n/a``, never as a number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

Run = Mapping[str, object]


def fmt(value: object, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |"
              for row in rows]
    return "\n".join(lines)


def stamp(data: Mapping[str, object]) -> str:
    """The provenance block every report starts with."""
    m = data.get("machine", {})
    assert isinstance(m, dict)
    versions = data.get("versions", {})
    assert isinstance(versions, dict)
    vers = ", ".join(f"{k} {v}" for k, v in versions.items())
    return "\n".join([
        f"- command: `{data.get('command')}`",
        f"- run: {data.get('started_at')} → {data.get('finished_at', 'unfinished')}",
        f"- machine: {m.get('nproc')} x {m.get('cpu_model')}, {m.get('memory_gib')} GiB, "
        f"Linux {m.get('kernel')}, Python {m.get('python')}, load average at start "
        f"{fmt_list(m.get('load_avg_at_start'))}",
        f"- versions: {vers}",
    ])


def fmt_list(values: object) -> str:
    if not isinstance(values, list):
        return "n/a"
    return " ".join(fmt(float(v), 2) for v in values)


def footer_text(data: Mapping[str, object]) -> str:
    m = data.get("machine", {})
    assert isinstance(m, dict)
    runs = data.get("runs")
    routers = ""
    if isinstance(runs, list):
        routers = " | routers: " + ", ".join(f"{r.get('router')} {r.get('version')}" for r in runs)
    return (f"{data.get('command')} | {data.get('started_at')} | {m.get('nproc')}x "
            f"{m.get('cpu_model')} | {data.get('versions')}{routers} | "
            f"settings: {data.get('settings')}")


def num(v: object) -> float:
    return float(v) if isinstance(v, int | float) else math.nan


def ms(v: object) -> float:
    return num(v) * 1000.0
