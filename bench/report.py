"""Markdown reports and PNGs from the benchmarks' JSON results; regenerates docs/benchmarks.md.

Usage: ``python -m bench.report [--results bench/results] [--docs docs/benchmarks.md]``.

Rules:
- Every number in a report comes from a results file; nothing is typed in. Text around the
  numbers (method, targets) is fixed wording; verdicts are computed.
- Each report states its command, machine, versions and settings next to its figures.
- A missing results file leaves its section out and says which command produces it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import plots
from bench.docs import benchmarks_doc
from bench.machine import now_utc, read_json
from bench.markdown import fmt, footer_text, num
from bench.report_noise import noise_markdown
from bench.report_overcommit import write_overcommit
from bench.report_overhead import overhead_markdown, overhead_ratios
from bench.report_replicas import replicas_markdown
from bench.report_routing import calibration_markdown, routing_markdown
from bench.report_soak import soak_markdown
from bench.report_specfirst import write_specfirst
from bench.report_speculation import render as speculation_markdown
from bench.report_speculation import render_variations
from bench.report_suite import suite_markdown

RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"

__all__ = ["DOCS", "RESULTS", "fmt", "main", "report_args"]


def write_routing(results: Path) -> str | None:
    path = results / "routing.json"
    if not path.exists():
        return None
    data = read_json(path)
    data["calibration"] = calibration_markdown(results)
    png = _figure(lambda p: plots.routing_figure(
        data["runs"], num(data["trace"]["ideal_hit_rate"]), footer_text(data), p),  # type: ignore[arg-type,index]
        results / "routing.png")
    text = routing_markdown(data, png)
    noise = results / "noise" / "routing.json"
    text += "\n## Noise: the benchmark repeated\n\n" + (
        noise_markdown(read_json(noise)) if noise.exists() else
        "No repeated runs: `python -m bench.routing --repeat 3 --routers ROUTERS "
        "--out bench/results/noise --no-report` writes them.") + "\n"
    (results / "routing.md").write_text(text)
    return text


def write_overhead(results: Path) -> str | None:
    path = results / "overhead.json"
    if not path.exists():
        return None
    data = read_json(path)
    png = _figure(lambda p: plots.overhead_figure(overhead_ratios(data), footer_text(data), p),
                  results / "overhead.png")
    text = overhead_markdown(data, png)
    (results / "overhead.md").write_text(text)
    return text


def write_soak(results: Path) -> str | None:
    path = results / "soak.json"
    if not path.exists():
        return None
    text = soak_markdown(read_json(path))
    (results / "soak.md").write_text(text)
    return text


def write_speculation(results: Path) -> str | None:
    path = results / "speculation.json"
    if not path.exists():
        return None
    text = speculation_markdown(read_json(path))
    variations = [read_json(p) for p in sorted(results.glob("speculation-*.json"))]
    if variations:
        text += "\n" + render_variations(variations)
    (results / "speculation.md").write_text(text)
    return text


def write_suite(results: Path) -> str | None:
    path = results / "suite.json"
    if not path.exists():
        return None
    text = suite_markdown(read_json(path))
    (results / "suite.md").write_text(text)
    return text


def write_replicas(results: Path, docs: Path) -> str | None:
    """Writes ``replicas.md``; returns the text for the page at ``docs`` (links from there)."""
    path = results / "replicas.json"
    if not path.exists():
        return None
    data = read_json(path)
    (results / "replicas.md").write_text(replicas_markdown(data))
    prefix = os.path.relpath(results, docs.parent).replace(os.sep, "/") + "/"
    return replicas_markdown(data, prefix)


def write_workers(results: Path) -> str | None:
    """Writes ``workers.md``; returns its text for the page."""
    # Imported here: bench.workers imports this module (through bench.routing).
    from bench.workers import markdown as workers_markdown  # noqa: PLC0415
    from bench.workers import rejudge  # noqa: PLC0415

    path = results / "workers.json"
    if not path.exists():
        return None
    data = read_json(path)
    if not data.get("verdicts"):
        return None  # an unfinished run
    # Judged again from the runs: the stored verdicts follow the rule of the day they were written.
    text = workers_markdown(rejudge(data) if isinstance(data.get("runs"), list) else data)
    (results / "workers.md").write_text(text)
    return text


def _figure(draw: object, path: Path) -> str | None:
    if plots.available() is not None:
        return None
    draw(path)  # type: ignore[operator]
    return path.name


def _demoted(text: str) -> str:
    """A report as a section of the page: headings two levels down."""
    return "\n".join("##" + ln if ln.startswith("#") else ln for ln in text.splitlines()) + "\n"


def report_args(results: Path) -> list[str]:
    """Arguments for ``main`` after a benchmark run: docs/benchmarks.md is rewritten only from
    the default results folder; results elsewhere get their page next to them."""
    if results.resolve() == RESULTS.resolve():
        return ["--results", str(results)]
    return ["--results", str(results), "--docs", str(results / "benchmarks.md")]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--docs", type=Path, default=DOCS)
    args = p.parse_args(argv)
    routing = write_routing(args.results)
    overhead = write_overhead(args.results)
    soak = write_soak(args.results)
    suite = write_suite(args.results)
    speculation = write_speculation(args.results)
    args.docs.parent.mkdir(parents=True, exist_ok=True)
    page = benchmarks_doc(routing, overhead, args.results, args.docs, now_utc(),
                          plots.available(), soak=soak, speculation=speculation,
                          suite=suite)
    overcommit = write_overcommit(args.results)
    if overcommit is not None:
        page += "\n" + "\n".join("##" + ln if ln.startswith("#") else ln
                                   for ln in overcommit.splitlines()) + "\n"
    specfirst = write_specfirst(args.results)
    if specfirst is not None:
        page += "\n" + "\n".join("##" + ln if ln.startswith("#") else ln
                                   for ln in specfirst.splitlines()) + "\n"
    replicas = write_replicas(args.results, args.docs)
    page += "\n" + _demoted(replicas if replicas is not None else "# Replica benchmark\n\n"
                             "No results yet: run `python -m bench.replicas`.")
    workers = write_workers(args.results)
    page += "\n" + _demoted(workers if workers is not None else "# Workers benchmark\n\n"
                            "No results yet: run `python -m bench.workers`.")
    args.docs.write_text(page)
    print(f"wrote {args.docs} and reports under {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
