"""The controller's Prometheus series, all named ``kvproxy_sidecar_spec_*``.

Rules: rendered by hand from the controller's plain state (cheap enough for every scrape);
``schedule_k{range}`` is what the engine runs now, ``proposed_k{range}`` what the last decision
wanted; a proxy's admin view reads ``schedule_k`` to show an engine's speculation settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_sidecar.speculation import schedule as sch
from engine_sidecar.speculation.rollout import RolloutState

if TYPE_CHECKING:
    from engine_sidecar.speculation.controller import Controller

P = "kvproxy_sidecar_spec_"


def _family(name: str, kind: str, help_text: str, rows: list[tuple[str, float]]) -> list[str]:
    out = [f"# HELP {P}{name} {help_text}", f"# TYPE {P}{name} {kind}"]
    return out + [f"{P}{name}{labels} {_num(v)}" for labels, v in rows]


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _by_range(schedule: sch.Schedule) -> list[tuple[str, float]]:
    return [(f'{{range="{r.label}"}}', float(r.k)) for r in schedule]


def render(c: Controller) -> str:
    st = c.stats
    lines = _family("controller_acting", "gauge",
                    "1 when the adaptive controller may restart the engine, 0 observe-only.",
                    [("", float(c.settings.act))])
    lines += _family("schedule_k", "gauge", "Draft length the engine runs at, per batch range.",
                     _by_range(c.engine.current_schedule()))
    if st.last is not None:
        lines += _family("proposed_k", "gauge", "Draft length the last decision chose, per "
                         "batch range.", _by_range(st.last.proposed))
        lines += _family("predicted_gain", "gauge", "Predicted goodput gain of the proposed "
                         "schedule over the current one (0.05 = 5 %).",
                         [("", st.last.predicted_gain)])
        lines += _family("required_gain", "gauge", "Gain a change needs now to pay for its "
                         "restart at the engine's load (0.05 = 5 %).",
                         [("", st.last.required_gain)])
    if st.last_change_gain is not None:
        lines += _family("last_change_predicted_gain", "gauge",
                         "Predicted gain of the last schedule rolled out.",
                         [("", st.last_change_gain)])
    if st.measured_gain is not None:
        lines += _family("last_change_measured_gain", "gauge", "Output tokens per busy second "
                         "since the last change over the window before it, minus 1.",
                         [("", st.measured_gain)])
    if st.out_s is not None:
        lines += _family("last_restart_seconds", "gauge", "How long the last rollout kept the "
                         "engine out (drain, restart, warm-up).", [("", st.out_s)])
    lines += _family("followup_pending", "gauge", "1 while the last change was made on thin "
                     "evidence and its one follow-up evaluation has not run yet.",
                     [("", float(c.state.followup))])
    lines += _family("shifts_total", "counter", "Acceptance shifts found by the change-point "
                     "test.", [("", float(st.shifts))])
    lines += _family("decisions_total", "counter", "Controller evaluations by outcome.",
                     [(f'{{action="{a}"}}', float(n)) for a, n in st.decisions.items()])
    lines += _family("reconfigurations_total", "counter", "Schedule rollouts by result.",
                     [(f'{{result="{r}"}}', float(n)) for r, n in st.reconfigurations.items()])
    lines += _family("rollout_state", "gauge", "1 for the rollout's current state.",
                     [(f'{{state="{s.value}"}}', float(c.rollout.state is s))
                      for s in RolloutState])
    lines += _family("step_time_factor", "gauge", "Measured over modelled step time.",
                     [('{kind="off"}', c.cost.factor(False)),
                      ('{kind="on"}', c.cost.factor(True))])
    return "\n".join(lines) + "\n"
