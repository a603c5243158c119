"""An engine's exposition is not trusted by the speculation controller: a scrape holding a value no
engine reports (not finite, negative, absurd) is not used, and nothing is decided or restarted on
it."""

from __future__ import annotations

import pytest

from engine_sidecar.speculation import schedule as sch
from engine_sidecar.speculation.controller import Controller, ControllerSettings
from engine_sidecar.speculation.lease import LocalLease
from engine_sidecar.speculation.policy import PolicySettings
from engine_sidecar.speculation.window import ImplausibleMetrics, snapshot_from_text


def _text(drafts: str, first: str, running: str = "40") -> str:
    return (f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n"
            f"vllm:spec_decode_num_drafts_total {drafts}\n"
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {first}\n')


class Engine:
    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.asked: list[sch.Schedule] = []

    def current_schedule(self) -> sch.Schedule:
        return sch.uniform(1, 64)

    async def metrics_text(self) -> str | None:
        return self.texts.pop(0) if self.texts else None

    async def reconfigure(self, schedule: sch.Schedule) -> None:
        self.asked.append(schedule)


@pytest.mark.parametrize(("drafts", "first", "running"), [
    ("+Inf", "50", "40"), ("{n}", "NaN", "40"), ("{n}", "+Inf", "40"), ("{n}", "{a}", "+Inf"),
    ("{n}", "{a}", "1e308"), ("{n}", "-5", "40"),
])
async def test_a_hostile_counter_decides_nothing_and_restarts_nothing(
    drafts: str, first: str, running: str,
) -> None:
    texts = [_text(drafts.format(n=1000 * i), first.format(a=100 * i), running)
             for i in range(1, 6)]
    with pytest.raises(ImplausibleMetrics):
        snapshot_from_text(texts[0], 0.0)
    engine, clock = Engine(texts), [0.0]
    settings = ControllerSettings(PolicySettings(max_k=4, max_batch=64, min_interval_s=0,
                                                 confirmations=1), poll_s=1, eval_s=1,
                                  window_s=100)
    controller = Controller("e", engine, settings, LocalLease())
    controller._now = lambda: clock[0]  # type: ignore[method-assign]
    decisions = []
    for _ in range(5):
        clock[0] += 10.0
        decisions.append(await controller.step())
    assert engine.asked == []
    assert all(d is None or d.action != "change" for d in decisions), decisions
