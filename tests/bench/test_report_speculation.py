"""The speculation report is generated from its results alone: the narrative about one run, with
that run's figures, lives in a dated notes file the report links to."""

import json
from pathlib import Path

from bench import report
from bench.report_speculation import NOTES, render

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _scaled(value, factor):
    """Every number of a results file times ``factor``: figures no hand-written text holds."""
    if isinstance(value, dict):
        return {k: _scaled(v, factor) for k, v in value.items()}
    if isinstance(value, list):
        return [_scaled(v, factor) for v in value]
    if isinstance(value, float):
        return value * factor
    return value


def test_the_report_prints_no_figure_its_data_do_not_hold():
    data = _scaled(json.loads((RESULTS / "speculation.json").read_text()), 1.37)
    text = render(data)
    goals = set(data["goals"])
    # Tables, headings, provenance and goals come from the data; any other line is fixed prose,
    # and fixed prose carries no figure.
    prose = [line for line in text.splitlines()
             if line and line not in goals and not line.startswith(("|", "#", "- "))]
    assert prose, "the link to the notes is prose"
    assert not [line for line in prose if any(c.isdigit() for c in line)]
    assert f"]({NOTES})" in text
    assert "120.4 ms" not in text and "-7.7 %" not in text


def test_the_notes_are_committed_dated_and_linked_from_the_docs_page(tmp_path):
    notes = (RESULTS / NOTES).read_text()
    assert notes.startswith("# Notes on the adaptive speculation run of 2026-11-24")
    assert "120.4 ms" in notes  # the narrative moved here, figures and all
    results = tmp_path / "results"
    results.mkdir()
    (results / "speculation.json").write_text((RESULTS / "speculation.json").read_text())
    docs = tmp_path / "docs" / "benchmarks.md"
    report.main(["--results", str(results), "--docs", str(docs)])
    assert f"]({NOTES})" in (results / "speculation.md").read_text()
    assert f"](../results/{NOTES})" in docs.read_text()  # the page's link reaches the notes
