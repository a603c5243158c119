"""An engine's exposition is not trusted by the speculation controller: a scrape holding a value no
engine reports (not finite, negative, absurd) is not used, and nothing is decided or restarted on
it.

The scrapes are built so that their plausible version makes the controller change the schedule
(first-position acceptance of 90 % on K=2: a longer draft clearly pays), which the control case
shows; the hostile versions of the same scrapes must then decide nothing at all. Used anyway, a
hostile first position would read as no acceptance (its sample dropped, the position missing) and
turn speculation down; a hostile draft or running count would leave the window deciding on a
count it could not read."""

from __future__ import annotations

import pytest

from engine_sidecar.speculation import schedule as sch
from engine_sidecar.speculation.controller import Controller, ControllerSettings
from engine_sidecar.speculation.lease import LocalLease
from engine_sidecar.speculation.policy import Decision, PolicySettings
from engine_sidecar.speculation.window import ImplausibleMetrics, snapshot_from_text

MAX_BATCH = 64
START = sch.uniform(2, MAX_BATCH)


def _text(drafts: str, first: str, running: str = "40", second: str = "0") -> str:
    return (f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n"
            f"vllm:spec_decode_num_drafts_total {drafts}\n"
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {first}\n'
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {second}\n')


def _scrapes(drafts: str, first: str, running: str) -> list[str]:
    """Five scrapes 10 s apart: 1,000 drafts each, 90 % of them accepting the first position
    and 80 % the second (on K=2 both are drafted every step)."""
    return [_text(drafts.format(n=1000 * i), first.format(a=900 * i), running,
                  second=str(800 * i)) for i in range(1, 6)]


class Engine:
    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.schedule = START
        self.asked: list[sch.Schedule] = []

    def current_schedule(self) -> sch.Schedule:
        return self.schedule

    async def metrics_text(self) -> str | None:
        return self.texts.pop(0) if self.texts else None

    async def reconfigure(self, schedule: sch.Schedule, on_drained=None) -> None:
        self.asked.append(schedule)
        self.schedule = schedule


async def _run(texts: list[str]) -> tuple[Engine, Controller, list[Decision | None]]:
    engine, clock = Engine(texts), [0.0]
    settings = ControllerSettings(PolicySettings(max_k=4, max_batch=MAX_BATCH, min_interval_s=0,
                                                 confirmations=1), poll_s=1, eval_s=1,
                                  window_s=100)
    controller = Controller("e", engine, settings, LocalLease())
    controller._now = lambda: clock[0]  # type: ignore[method-assign]
    decisions = []
    for _ in range(5):
        clock[0] += 10.0
        decisions.append(await controller.step())
    return engine, controller, decisions


async def test_the_plausible_scrapes_change_the_schedule() -> None:
    """The control: the same scrapes with plausible values lengthen the draft to K=4."""
    engine, controller, decisions = await _run(_scrapes("{n}", "{a}", "40"))
    assert next(d.action for d in decisions if d is not None) == "change", decisions
    assert engine.asked, decisions
    assert [sch.k_for_batch(engine.asked[0], b, 4) for b in range(1, MAX_BATCH + 1)] \
        == [4] * MAX_BATCH, sch.render(engine.asked[0])
    assert controller.stats.reconfigurations["ok"] >= 1


@pytest.mark.parametrize(("drafts", "first", "running"), [
    ("+Inf", "{a}", "40"), ("{n}", "NaN", "40"), ("{n}", "+Inf", "40"), ("{n}", "{a}", "+Inf"),
    ("{n}", "{a}", "1e308"), ("{n}", "-5", "40"),
])
async def test_a_hostile_counter_decides_nothing_and_restarts_nothing(
    drafts: str, first: str, running: str,
) -> None:
    texts = _scrapes(drafts, first, running)
    with pytest.raises(ImplausibleMetrics):
        snapshot_from_text(texts[0], 0.0)
    engine, controller, decisions = await _run(texts)
    assert engine.asked == []
    assert engine.schedule == START
    # Not even a "wait" or a "keep": no scrape reached the window, so nothing was evaluated.
    assert decisions == [None] * 5, decisions
    assert controller.window.polls() == []
    assert sum(controller.stats.decisions.values()) == 0, controller.stats.decisions
    assert sum(controller.stats.reconfigurations.values()) == 0
