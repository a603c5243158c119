"""The cost model's choice asks for the rendezvous tie-break only when there is a tie, and picks and
orders exactly as it does with the tie-break always at hand."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from proxy.core.costmodel import Estimate, choose


def reference(estimates: Sequence[Estimate], tolerance: float,
              order: Mapping[str, int]) -> tuple[str, ...]:
    """The choice with the tie-break part of every key (as it was computed before)."""
    if not estimates:
        return ()
    best = min(e.cost_s for e in estimates)
    near = [e for e in estimates if e.cost_s <= best * (1.0 + tolerance)]
    pick = min(near, key=lambda e: (-e.held, e.wait_s, e.cost_s, order[e.name]))
    rest = sorted((e for e in estimates if e is not pick),
                  key=lambda e: (e.cost_s, e.wait_s, order[e.name]))
    return (pick.name, *(e.name for e in rest))


def fleet(rng: random.Random, n: int, values: Sequence[float]) -> list[Estimate]:
    out = []
    for i in range(n):
        wait = rng.choice(values)
        own = rng.choice(values)
        out.append(Estimate(f"e{i}", wait, wait + own, rng.choice((0.0, 16.0, 64.0)),
                            wait + own * 2))
    return out


@pytest.mark.parametrize("values", [
    [0.0, 0.01, 0.02],  # few distinct figures: ties everywhere (an idle pool)
    [round(0.001 * k, 3) for k in range(1, 2000)],  # figures that seldom tie (a loaded pool)
])
def test_the_choice_is_the_one_with_the_tie_break_always_computed(values: list[float]) -> None:
    rng = random.Random(7)
    asked = 0
    for _ in range(2000):
        estimates = fleet(rng, rng.randint(1, 9), values)
        order = {e.name: rng.randint(-1000, 1000) for e in estimates}

        def tie_break(order: dict[str, int] = order) -> dict[str, int]:
            nonlocal asked
            asked += 1
            return order

        tolerance = rng.choice((0.0, 0.05, 0.3))
        assert choose(estimates, tolerance, tie_break) == reference(estimates, tolerance, order)
    if len(values) < 10:
        assert asked > 1000  # ties were common and broken by the order
    else:
        assert asked < 400  # mostly decided without it


def test_equal_figures_are_ordered_by_the_tie_break() -> None:
    estimates = [Estimate(n, 0.1, 0.2, 0.0, 0.3) for n in ("a", "b", "c")]
    assert choose(estimates, 0.0, lambda: {"a": 2, "b": 0, "c": 1}) == ("b", "c", "a")
