"""The overcommit benchmark's report: ``bench/results/overcommit.json`` -> Markdown.

Rules: every number comes from the results file; the verdicts against the targets are computed
(guard vs ``threshold``, per round: at least 5x fewer preemptions, critical p99 TTFT at most 0.7x,
goodput at least equal), never typed in. A goal is met only when it is met in every round; the
median and each round's ratio are shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from bench.machine import read_json
from bench.markdown import fmt, ms, num, stamp, table

READING = (
    "Reading the figures: an engine admits a request on its prompt's KV blocks and takes the "
    "blocks of its answer while it decodes, so a burst admitted at low usage fills the cache only "
    "later. The guard counts what the proxy has committed to each engine (prompts not yet "
    "computed, expected output still to come, the output length learned from the pool's "
    "answers) and stops sending sheddable work where that commitment reaches the sheddable "
    "threshold, standard work at the standard threshold. The engines then stop running out of "
    "KV, and critical requests stop queueing behind recomputed ones. The cost is throughput: "
    "the guard keeps each engine's peak KV at the class thresholds (0.85 / 0.95 by default, "
    "the headroom kept for the classes that are never shed), where KV thresholds alone let it "
    "run full and preempt; decoding throughput grows with the batch, so the guard completes "
    "fewer sheddable and standard tokens in this open-loop run, where a shed request is never "
    "retried."
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


def _ratios(arms: Mapping[str, Mapping[str, object]]) -> tuple[float, float, float] | None:
    """(preemptions threshold/guard, critical p99 guard/threshold, goodput guard/threshold)."""
    guard, base = arms.get("guard"), arms.get("threshold")
    if guard is None or base is None:
        return None
    pre_g, pre_b = num(guard["preemptions"]), num(base["preemptions"])
    fewer = pre_b / pre_g if pre_g > 0 else float("inf") if pre_b > 0 else 1.0
    p99 = ms(_cls(guard, "critical")["ttft_p99_s"]) / ms(_cls(base, "critical")["ttft_p99_s"])
    good = num(guard["goodput_tokens_per_s"]) / num(base["goodput_tokens_per_s"])
    return fewer, p99, good


def _show(value: float, digits: int) -> str:
    return "∞" if value == float("inf") else fmt(value, digits)


def _spread(values: list[float], digits: int, unit: str = "") -> str:
    fmt = _show  # a guard round without preemptions is an infinite ratio
    ordered = sorted(values)
    mid = ordered[len(ordered) // 2]
    each = ", ".join(f"{fmt(v, digits)}{unit}" for v in values)
    return f"{fmt(mid, digits)}{unit} (rounds: {each})" if len(values) > 1 \
        else f"{fmt(mid, digits)}{unit}"


def _targets(rounds: list[Mapping[str, Mapping[str, object]]]) -> str:
    ratios = [r for r in (_ratios(arms) for arms in rounds) if r is not None]
    if not ratios:
        return "Targets need both the `guard` and the `threshold` arms."
    goals = [("preemptions, threshold-only / guard", ">= 5x", lambda v: v >= 5, 1, "x"),
             ("critical p99 TTFT, guard / threshold-only", "<= 0.7", lambda v: v <= 0.7, 2, ""),
             ("goodput (tokens/s), guard / threshold-only", ">= 1.0", lambda v: v >= 1.0, 2, "")]
    rows = []
    for i, (name, goal, met, digits, unit) in enumerate(goals):
        values = [r[i] for r in ratios]
        hits = sum(1 for v in values if met(v))
        verdict = "met" if hits == len(values) else "not met" if hits == 0 else \
            f"met in {hits} of {len(values)} rounds"
        rows.append([name, goal, _spread(values, digits, unit), verdict])
    return table(["target", "goal", "median (each round)", "verdict"], rows)


def _rounds(data: Mapping[str, object]) -> list[Mapping[str, Mapping[str, object]]]:
    rounds = data.get("rounds")
    if isinstance(rounds, list):
        return rounds
    arms = data["arms"]  # a results file from before rounds
    assert isinstance(arms, dict)
    return [arms]


def overcommit_markdown(data: Mapping[str, object]) -> str:
    rounds = _rounds(data)
    settings = data.get("settings", {})
    header = ["round", "arm", "engine preemptions", "critical TTFT p50 (ms)",
              "critical TTFT p99 (ms)", "goodput (output tokens/s)", "completed requests",
              "shed critical / standard / sheddable", "failed"]
    rows = [[str(n + 1), *row] for n, arms in enumerate(rounds) for row in _rows(arms)]
    return "\n".join([
        "# Overcommit benchmark", "", stamp(data), f"- settings: `{settings}`", "",
        "## Targets", "", _targets(rounds), "", "## Figures", "", table(header, rows), "",
        "Same seeded arrival schedule for every arm and round; arms interleaved within each round, "
        "each on a fresh engine process and a fresh proxy. Latencies are wall-clock at the client "
        f"(the engines run {num(_fleet(settings).get('time_scale')):g}x faster than the modelled "
        "GPU).", "",
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
