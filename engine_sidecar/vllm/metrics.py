"""Reading the vLLM metrics the sidecar needs, and writing the series it derives.

Rules:
- Pure text in, values or text out.
- Reads only what the sidecar uses: request counts (to drain) and speculative-decoding counters
  (to derive acceptance); sums over the ``engine`` label, as data-parallel ranks are one engine.
- Derived series are all named ``kvproxy_sidecar_*`` so they never collide with ``vllm:*``.
- An engine's text is not trusted: a counter or gauge that is not a finite number in
  0..``MAX_VALUE`` is no value at all (an infinite count would read as perfect acceptance, a huge
  one overflows the controller's arithmetic), and only the first ``MAX_POSITIONS`` draft
  positions are read.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from engine_sidecar.vllm.spec import SpecCounters, SpecStats

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
MAX_VALUE = 1e15  # past any count an engine reaches; sums of such stay exact enough and finite
MAX_POSITIONS = 64  # the most draft tokens a schedule may ask for


def plausible(value: float) -> bool:
    """A count or gauge value the sidecar may use: finite, not negative, not absurd."""
    return 0.0 <= value <= MAX_VALUE  # NaN and infinities fail the comparison


def implausible(samples: list[Sample], names: Collection[str]) -> str | None:
    """The first series of ``names`` with a value ``plausible`` refuses, if any."""
    return next((s.name for s in samples if s.name in names and not plausible(s.value)), None)


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> Iterator[Sample]:
    """Samples of a Prometheus text exposition; malformed lines are skipped."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group("labels") or ""))
        yield Sample(match.group("name"), labels, value)


def total(samples: list[Sample], name: str) -> float | None:
    values = [s.value for s in samples if s.name == name and plausible(s.value)]
    return sum(values) if values else None


def in_flight(samples: list[Sample]) -> float | None:
    """Running plus waiting requests; ``None`` when vLLM reported neither."""
    running, waiting = total(samples, RUNNING), total(samples, WAITING)
    if running is None and waiting is None:
        return None
    return (running or 0.0) + (waiting or 0.0)


def spec_counters(samples: list[Sample]) -> SpecCounters | None:
    drafts = total(samples, SPEC_DRAFTS)
    if drafts is None:
        return None
    per_pos: dict[int, float] = {}
    for s in samples:
        position = s.labels.get("position", "")
        if (s.name == SPEC_ACCEPTED_PER_POS and position.isdigit() and len(position) <= 3
                and int(position) < MAX_POSITIONS and plausible(s.value)):
            pos = int(position)
            per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1))
    return SpecCounters(drafts=drafts, draft_tokens=total(samples, SPEC_DRAFT_TOKENS) or 0.0,
                        accepted=total(samples, SPEC_ACCEPTED) or 0.0,
                        accepted_per_pos=positions)


@dataclass(frozen=True)
class SidecarState:
    ready: bool
    draining: bool
    engine_up: bool
    restarts: int
    num_speculative_tokens: int


def _gauge(name: str, help_text: str, values: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
    lines += [f"{name}{labels} {_number(value)}" for labels, value in values]
    return lines


def _number(value: float) -> str:
    # Full precision (repr), and whole numbers without a trailing ".0" for readability.
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render_derived(state: SidecarState, spec: SpecStats | None) -> str:
    """The sidecar's own series in Prometheus text format."""
    p = "kvproxy_sidecar_"
    lines = _gauge(p + "ready", "1 when the engine is warmed up and accepting requests.",
                   [("", float(state.ready))])
    lines += _gauge(p + "draining", "1 while the sidecar drains the engine before stopping.",
                    [("", float(state.draining))])
    lines += _gauge(p + "engine_up", "1 while the vLLM process is running.",
                    [("", float(state.engine_up))])
    lines += [f"# HELP {p}engine_restarts_total Times the vLLM process was restarted.",
              f"# TYPE {p}engine_restarts_total counter",
              f"{p}engine_restarts_total {state.restarts}"]
    if state.num_speculative_tokens > 0:
        lines += spec_lines(state.num_speculative_tokens, spec)
    return "\n".join(lines) + "\n"


def spec_lines(configured: int, spec: SpecStats | None) -> list[str]:
    """The ``kvproxy_sidecar_spec_*`` series (the simulator exports the same ones)."""
    p = "kvproxy_sidecar_spec_"
    lines = _gauge(p + "num_speculative_tokens", "Draft tokens per step the engine runs with.",
                   [("", float(configured))])
    if spec is None:
        return lines
    lines += _gauge(p + "window_seconds", "Span of the window the spec figures cover.",
                    [("", spec.window_s)])
    lines += _gauge(p + "window_drafts", "Verification steps with drafts inside the window.",
                    [("", spec.drafts)])
    if spec.acceptance_rate is not None:
        lines += _gauge(p + "acceptance_rate", "Accepted / proposed draft tokens in the window.",
                        [("", spec.acceptance_rate)])
    if spec.mean_acceptance_length is not None:
        lines += _gauge(p + "mean_acceptance_length",
                        "Tokens per verification step in the window, bonus token included.",
                        [("", spec.mean_acceptance_length)])
    if spec.per_position:
        lines += _gauge(p + "acceptance_per_position",
                        "Share of steps whose draft was accepted up to this position.",
                        [(f'{{position="{i}"}}', r) for i, r in enumerate(spec.per_position)])
    if spec.best_num_speculative_tokens is not None:
        lines += _gauge(p + "best_num_speculative_tokens",
                        "Draft length that would have maximised tokens per unit of step time.",
                        [("", float(spec.best_num_speculative_tokens))])
    return lines


def combine(engine_text: str | None, derived: str) -> str:
    """vLLM's exposition followed by the sidecar's; a missing engine leaves only ours."""
    if not engine_text:
        return derived
    return engine_text.rstrip("\n") + "\n" + derived
