"""The overcommit benchmark's report: ``bench/results/overcommit.json`` -> Markdown.

Rules: every number comes from the results file; the verdicts against the targets are computed
(guard vs ``threshold``: at least 5x fewer preemptions, critical p99 TTFT at most 0.7x, goodput
at least equal), never typed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from bench.machine import read_json
from bench.markdown import fmt, ms, num, stamp, table

READING = (
    "Reading the figures: the guard can only stop *new* work. An engine admits a request on its "
    "prompt's KV blocks; the blocks its output needs come later, while the request runs. A burst "
    "admitted at low usage therefore grows into preemptions after any signal the router sees "
    "(usage, its growth, preemptions), and closing the engine then keeps only later arrivals "
    "away. Where the preemptions come from committed outputs, as in this mix of long outputs, "
    "the guard mostly shortens the critical queue (it keeps sheddable and standard work off "
    "preempting engines) and sheds more; preventing those preemptions needs the outputs' KV "
    "reserved at admission (the proxy knows each request's `max_tokens` and the engine's block "
    "count), which this guard does not do."
)

ARM_TEXT = {
    "guard": "overcommit guard (default config)",
    "threshold": "KV thresholds only (`pressure.enabled = false`)",
    "none": "no admission control (guard off, thresholds above 1)",
}


def _cls(arm: Mapping[str, object], cls: str) -> Mapping[str, object]:
    classes = arm["classes"]
    assert isinstance(classes, dict)
    found = classes[cls]
    assert isinstance(found, dict)
    return found


def _rows(arms: Mapping[str, Mapping[str, object]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, arm in arms.items():
        crit = _cls(arm, "critical")
        shed = " / ".join(str(_cls(arm, c)["shed"]) for c in ("critical", "standard", "sheddable"))
        failed = sum(int(num(_cls(arm, c)["failed"])) for c in ("critical", "standard",
                                                                  "sheddable"))
        rows.append([ARM_TEXT.get(name, name), f"{num(arm['preemptions']):.0f}",
                     f"{ms(crit['ttft_p50_s']):.0f}", f"{ms(crit['ttft_p99_s']):.0f}",
                     f"{num(arm['goodput_tokens_per_s']):.0f}", str(arm["completed"]), shed,
                     str(failed)])
    return rows


def _targets(arms: Mapping[str, Mapping[str, object]]) -> str:
    guard, base = arms.get("guard"), arms.get("threshold")
    if guard is None or base is None:
        return "Targets need both the `guard` and the `threshold` arms."
    pre_g, pre_b = num(guard["preemptions"]), num(base["preemptions"])
    fewer = pre_b / pre_g if pre_g > 0 else float("inf") if pre_b > 0 else 1.0
    p99 = ms(_cls(guard, "critical")["ttft_p99_s"]) / ms(_cls(base, "critical")["ttft_p99_s"])
    good = num(guard["goodput_tokens_per_s"]) / num(base["goodput_tokens_per_s"])
    verdict = [
        ["preemptions, threshold-only / guard", ">= 5x", f"{fmt(fewer, 1)}x",
         "met" if fewer >= 5 else "not met"],
        ["critical p99 TTFT, guard / threshold-only", "<= 0.7", fmt(p99, 2),
         "met" if p99 <= 0.7 else "not met"],
        ["goodput (tokens/s), guard / threshold-only", ">= 1.0", fmt(good, 2),
         "met" if good >= 1.0 else "not met"],
    ]
    return table(["target", "goal", "measured", "verdict"], verdict)


def overcommit_markdown(data: Mapping[str, object]) -> str:
    arms = data["arms"]
    assert isinstance(arms, dict)
    settings = data.get("settings", {})
    header = ["arm", "engine preemptions", "critical TTFT p50 (ms)", "critical TTFT p99 (ms)",
              "goodput (output tokens/s)", "completed requests",
              "shed critical / standard / sheddable", "failed"]
    return "\n".join([
        "# Overcommit benchmark", "", stamp(data), f"- settings: `{settings}`", "",
        "## Targets", "", _targets(arms), "", "## Figures", "", table(header, _rows(arms)), "",
        "Same seeded arrival schedule for every arm; each arm on a fresh engine process and a "
        "fresh proxy. Latencies are wall-clock at the client (the engines run "
        f"{num(_fleet(settings).get('time_scale')):g}x faster than the modelled GPU).", "",
        READING, "",
    ])


def _fleet(settings: object) -> Mapping[str, object]:
    fleet = settings.get("fleet") if isinstance(settings, dict) else None
    return fleet if isinstance(fleet, dict) else {}


def write_overcommit(results: Path) -> str | None:
    path = results / "overcommit.json"
    if not path.exists():
        return None
    text = overcommit_markdown(read_json(path))
    (results / "overcommit.md").write_text(text)
    return text
