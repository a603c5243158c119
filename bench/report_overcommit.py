"""The overcommit benchmark's report: ``bench/results/overcommit.json`` -> Markdown.

Rules: every number comes from the results file; the verdicts against the targets are computed
(guard vs ``threshold``, per round: at least 5x fewer preemptions, critical p99 TTFT at most 0.7x,
goodput at least equal), never typed in. A goal is met only when it is met in every round; the
median and each round's ratio are shown. Goodput is the SLO-bound figure (``bench.slo``); raw
throughput is shown beside it with its own ratio, so that nothing is hidden.
- Goodput's denominator is the one the results file names (``goodput_denominator``): the
  schedule's arrival window, the same for every arm (runs since 2026-11-24), or each arm's own
  span (older runs). With the common window, the old per-span figure is shown beside it as
  "goodput over own span (old measure)", and raw throughput is over the arm's own span.
- Notes written by a person about a run live in ``overcommit-notes.md`` next to the results and
  are included verbatim, under a heading that says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

from bench.machine import read_json
from bench.markdown import fmt, ms, num, stamp, table

CLASSES = ("critical", "standard", "sheddable")
NOTES = "overcommit-notes.md"

READING = (
    "Reading the figures: an engine admits a request on its prompt's KV blocks and takes the "
    "blocks of its answer while it decodes, so a burst admitted at low usage fills the cache only "
    "later. KV thresholds alone look at usage *now* and let an engine run full and preempt: "
    "preempted requests are recomputed, and everyone behind them in the FCFS queue waits. The "
    "guard counts what the proxy has committed to each engine (prompts not yet computed, expected "
    "output still to come, the output length learned from the pool's answers) and stops sending "
    "sheddable work where that forecast of the engine's peak reaches the sheddable mark for "
    "committed KV, standard work at the standard mark; critical work is never closed. Work it "
    "defers is held in the proxy for a short, bounded time (1 s standard, 4 s sheddable) and "
    "admitted as soon as answers in flight end and make room; what is still refused then gets "
    "503 with `Retry-After`, and the clients come back for it, bounded as real clients are. "
    "The paced arm, where it was run, is the guard with `pressure.pace_standard = true`: a "
    "standard request that only the forecast still refuses when its hold is up goes to an "
    "engine whose own figures (no preemption, KV usage and its projection under the standard "
    "threshold) leave room."
)

ARM_TEXT = {
    "guard": "overcommit guard (default config)",
    "paced": "guard, standard paced past the forecast (`pressure.pace_standard = true`)",
    "threshold": "KV thresholds only (`pressure.enabled = false`)",
    "none": "no admission control (guard off, thresholds above 1)",
}

Arms = Mapping[str, Mapping[str, object]]


def _cls(arm: Mapping[str, object], cls: str) -> Mapping[str, object]:
    classes = arm["classes"]
    assert isinstance(classes, dict)
    found = classes[cls]
    assert isinstance(found, dict)
    return found


def _throughput(arm: Mapping[str, object]) -> float:
    """Completed output tokens/s; results from before goodput was SLO-bound called it goodput."""
    raw = arm.get("throughput_tokens_per_s")
    return num(raw if raw is not None else arm.get("goodput_tokens_per_s"))


def _goodput(arm: Mapping[str, object]) -> float:
    """Output tokens/s of requests within their objectives (NaN in results without them)."""
    return num(arm.get("goodput_tokens_per_s")) if "throughput_tokens_per_s" in arm else math.nan


def _goodput_own_span(arm: Mapping[str, object]) -> str:
    """The old goodput (good tokens over the arm's own span), where the results have it."""
    value = arm.get("goodput_own_span_tokens_per_s")
    return "-" if value is None else f"{num(value):.0f}"


def _classes_of(arm: Mapping[str, object], key: str) -> str:
    return " / ".join(fmt(_cls(arm, c).get(key)) for c in CLASSES)


def _rows(arms: Arms) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, arm in arms.items():
        crit = _cls(arm, "critical")
        failed = sum(int(num(_cls(arm, c)["failed"])) for c in CLASSES)
        rows.append([ARM_TEXT.get(name, name), f"{num(arm['preemptions']):.0f}",
                     f"{ms(crit['ttft_p50_s']):.0f}", f"{ms(crit['ttft_p99_s']):.0f}",
                     f"{_goodput(arm):.0f}", _goodput_own_span(arm), f"{_throughput(arm):.0f}",
                     fmt(arm["completed"]),
                     fmt(arm.get("within_slo")), _classes_of(arm, "shed"), str(failed)])
    return rows


def _class_rows(arms: Arms) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, arm in arms.items():
        for cls in CLASSES:
            c = _cls(arm, cls)
            rows.append([name, cls, fmt(c["sent"]), fmt(c["completed"]), fmt(c.get("within_slo")),
                         f"{fmt(c.get('retried'))} ({fmt(c.get('retries'))})", fmt(c["shed"]),
                         fmt(c["failed"]), f"{ms(c['ttft_p50_s']):.0f}",
                         f"{ms(c['ttft_p99_s']):.0f}"])
    return rows


def _ratio(value: float, base: float) -> float:
    if base > 0:
        return value / base
    return float("inf") if value > 0 else 1.0


def _ratios(arms: Arms) -> tuple[float, float, float, float] | None:
    """(preemptions threshold/guard, critical p99 guard/threshold, goodput and raw throughput
    guard/threshold)."""
    guard, base = arms.get("guard"), arms.get("threshold")
    if guard is None or base is None:
        return None
    fewer = _ratio(num(base["preemptions"]), num(guard["preemptions"]))
    p99 = ms(_cls(guard, "critical")["ttft_p99_s"]) / ms(_cls(base, "critical")["ttft_p99_s"])
    return (fewer, p99, _goodput(guard) / _goodput(base),
            _throughput(guard) / _throughput(base))


def _show(value: float, digits: int) -> str:
    return "∞" if value == float("inf") else fmt(value, digits)


def _spread(values: list[float], digits: int, unit: str = "") -> str:
    ordered = sorted(values)
    mid = ordered[len(ordered) // 2]
    each = ", ".join(f"{_show(v, digits)}{unit}" for v in values)
    return f"{_show(mid, digits)}{unit} (rounds: {each})" if len(values) > 1 \
        else f"{_show(mid, digits)}{unit}"


Goal = tuple[str, str, Callable[[float], bool], int, str]
GOALS: list[Goal] = [
    ("preemptions, threshold-only / guard", ">= 5x", lambda v: v >= 5, 1, "x"),
    ("critical p99 TTFT, guard / threshold-only", "<= 0.7", lambda v: v <= 0.7, 2, ""),
    ("goodput (tokens/s within objectives), guard / threshold-only", ">= 1.0",
     lambda v: v >= 1.0, 2, ""),
    ("raw throughput over own span (completed tokens/s), guard / threshold-only",
     "shown beside goodput",
     lambda v: v >= 1.0, 2, ""),
]


def _verdict(values: list[float], met: Callable[[float], bool]) -> str:
    if any(math.isnan(v) for v in values):
        return "not measured"
    hits = sum(1 for v in values if met(v))
    if hits == len(values):
        return "met"
    return "not met" if hits == 0 else f"met in {hits} of {len(values)} rounds"


def _targets(rounds: list[Arms]) -> str:
    ratios = [r for r in (_ratios(arms) for arms in rounds) if r is not None]
    if not ratios:
        return "Targets need both the `guard` and the `threshold` arms."
    rows = []
    for i, (name, goal, met, digits, unit) in enumerate(GOALS):
        values = [r[i] for r in ratios]
        verdict = _verdict(values, met)
        if i == len(GOALS) - 1:  # not a goal of its own
            verdict = f"(>= 1.0: {verdict})"
        rows.append([name, goal, _spread(values, digits, unit), verdict])
    return table(["target", "goal", "median (each round)", "verdict"], rows)


def _rounds(data: Mapping[str, object]) -> list[Arms]:
    rounds = data.get("rounds")
    if isinstance(rounds, list):
        return rounds
    arms = data["arms"]  # a results file from before rounds
    assert isinstance(arms, dict)
    return [arms]


def _method(settings: Mapping[str, object]) -> str:
    slo = settings.get("objectives")
    retries = settings.get("client_retries")
    if not isinstance(slo, dict):
        return ("Clients did not retry and goodput was not bound by latency objectives in this "
                "run: its goodput is completed output tokens/s.")
    ttft = slo.get("ttft_s", {})
    bounds = ", ".join(f"{c} {fmt(num(ttft.get(c)), 1)} s" for c in CLASSES)
    return (
        f"Clients retry a refused request (503, 429) at most {retries} times, after its "
        "`Retry-After`, as the OpenAI SDKs do; a request still refused then is lost. Latency "
        f"objectives, the same for every arm and fixed before the run: TTFT at most {bounds}, "
        "counted from the client's first send (waits before retries included), and TPOT (mean "
        f"time per output token after the first) at most {ms(slo.get('tpot_s')):.0f} ms. "
        "Goodput = output tokens/s of the requests that completed within their objectives "
        f"(DistServe's definition), {_denominator(settings)}"
    )


def _denominator(settings: Mapping[str, object]) -> str:
    """How this run's goodput and raw throughput were divided (see the module's rules)."""
    if settings.get("goodput_denominator") != "arrival_window":
        return ("and raw throughput = output tokens/s of every completed request; both over the "
                "arm's own span, first send to last answer.")
    window = fmt(num(settings.get("arrival_window_s")), 1)
    return (
        f"over the schedule's arrival window ({window} s, first to last scheduled arrival), the "
        "same for every arm, so that the ratio of two arms' goodputs is the ratio of their "
        "tokens served within objectives; raw throughput over own span = output tokens/s of "
        "every completed request over the arm's own span, first send to last answer. Runs "
        "before 2026-11-24 divided goodput by each arm's own span, which scores an arm that "
        "serves one more request, late, after everything else lower although it did strictly "
        "more good work; that old figure is shown as goodput over own span."
    )


def overcommit_markdown(data: Mapping[str, object], notes: str | None = None) -> str:
    rounds = _rounds(data)
    settings = data.get("settings", {})
    assert isinstance(settings, dict)
    header = ["round", "arm", "engine preemptions", "critical TTFT p50 (ms)",
              "critical TTFT p99 (ms)", "goodput (tokens/s within objectives)",
              "goodput over own span (old measure)",
              "raw throughput over own span (completed tokens/s)", "completed requests",
              "within objectives", "lost to shedding critical / standard / sheddable", "failed"]
    rows = [[str(n + 1), *row] for n, arms in enumerate(rounds) for row in _rows(arms)]
    class_header = ["arm", "class", "sent", "completed", "within objectives",
                    "retried requests (retries)", "lost to shedding", "failed", "TTFT p50 (ms)",
                    "TTFT p99 (ms)"]
    per_class = [f"Round {n + 1}:\n\n{table(class_header, _class_rows(arms))}"
                 for n, arms in enumerate(rounds)]
    parts = [
        "# Overcommit benchmark", "", stamp(data), f"- settings: `{settings}`", "",
        _method(settings), "",
        "## Targets", "", _targets(rounds), "", "## Figures", "", table(header, rows), "",
        "Same seeded arrival schedule for every arm and round; arms interleaved within each round, "
        "each on a fresh engine process and a fresh proxy. Latencies are wall-clock at the client "
        f"(the engines run {num(_fleet(settings).get('time_scale')):g}x faster than the modelled "
        "GPU).", "",
        "## Per class", "", *"\n\n".join(per_class).split("\n"), "",
        READING, "",
    ]
    if notes:
        parts += ["## Notes on this run (written by hand)", "", notes.strip(), ""]
    return "\n".join(parts)


def _fleet(settings: object) -> Mapping[str, object]:
    fleet = settings.get("fleet") if isinstance(settings, dict) else None
    return fleet if isinstance(fleet, dict) else {}


def write_overcommit(results: Path) -> str | None:
    path = results / "overcommit.json"
    if not path.exists():
        return None
    notes = results / NOTES
    text = overcommit_markdown(read_json(path), notes.read_text() if notes.exists() else None)
    (results / "overcommit.md").write_text(text)
    return text
