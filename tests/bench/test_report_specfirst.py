"""The speculative-first report: verdicts computed from the rows, extra arms and tables shown."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report_specfirst import render


def _row(arm: str, gpu: float, p90: float, level: float = 0.9) -> dict[str, object]:
    return {"agreement": level, "arm": arm, "requests": 10, "draft_share": 0.8,
            "target_gpu_s_per_1k": gpu, "e2e_p90": p90, "target_only_requests": 0}


def test_report_reads_every_results_file(tmp_path: Path) -> None:
    rows = [_row("target_only", 5.0, 5.0), _row("speculative_first", 2.0, 6.0),
            _row("speculative_first/prompt_logprobs", 6.25, 40.0)]
    settings = {"requests": 10, "rate": 2.0, "seed": 7}
    (tmp_path / "specfirst.json").write_text(json.dumps({"settings": settings, "rows": rows}))
    (tmp_path / "specfirst-mid-load.json").write_text(json.dumps(
        {"settings": settings | {"rate": 1.0}, "rows": rows[:2]}))
    (tmp_path / "specfirst-window-2rps.json").write_text(json.dumps(
        {"settings": settings, "rows": [_row("speculative_first/window=0.1", 1.5, 7.0)]}))
    text = render(tmp_path)
    assert text is not None
    assert "2.50x fewer target GPU-seconds per 1k tokens (goal >= 2x: met)" in text
    assert "end-to-end p90 1.20x target-only (goal <= 1.3x: met)" in text
    assert "verifying through `prompt_logprobs` (no prefix cache): 0.80x fewer" in text
    assert "Middle load (settings" in text
    assert "speculative_first/window=0.1" in text
