"""The idle floor is a lower bound of every router's TTFT, request by request, on the simulator's
own engine (the offline replay), and it is exact where the bound is reached: a lone request on
an idle engine."""

from dataclasses import replace

import pytest

from bench.idle_floor import floor_percentiles, idle_floors
from bench.replay import CacheAware, KvproxyRouter, replay
from bench.traces import TraceRequest
from proxy.core.config import RoutingConfig

pytest.importorskip("engine_sidecar.sim.scheduler")

PROFILE = "llama70b-h100x4"
# Three documents of 8-24 blocks, each read by several requests close together: queues, reuse,
# and requests that arrive while their document is still being computed elsewhere.
REQS = [TraceRequest(i, i * 0.15, 512 * (8 + 8 * (i % 3)) + 60, 6,
                     tuple(range(1000 * (i % 3), 1000 * (i % 3) + 8 + 8 * (i % 3))))
        for i in range(15)]


@pytest.mark.parametrize("router", [lambda: KvproxyRouter("expected_ttft", 2, RoutingConfig()),
                                    lambda: KvproxyRouter("round_robin", 2, RoutingConfig()),
                                    lambda: CacheAware(2)])
def test_no_router_beats_the_floor_on_any_request(router: object) -> None:
    floors = idle_floors(REQS, PROFILE)
    out = replay(REQS, router(), engines=2, profile=PROFILE,  # type: ignore[operator]
                 rate_scale=1.0, scrape_s=0.6)
    assert len(out.ttft) == len(REQS)
    for i, floor in enumerate(floors):
        assert 0.0 < floor <= out.ttft[i] + 1e-9, (i, floor, out.ttft[i])
    # Not a bound that holds because it is trivially small: some request meets it exactly.
    assert any(abs(out.ttft[i] - f) < 1e-9 for i, f in enumerate(floors))


def test_a_lone_request_on_an_idle_engine_is_its_floor_exactly() -> None:
    lone = [TraceRequest(0, 0.0, 512 * 20 + 60, 6, tuple(range(20)))]
    out = replay(lone, KvproxyRouter("round_robin", 1, RoutingConfig()), engines=1,
                 profile=PROFILE, rate_scale=1.0, scrape_s=0.6)
    assert idle_floors(lone, PROFILE) == [pytest.approx(out.ttft[0], abs=1e-12)]


def test_a_prefix_carried_before_is_held_and_only_later_requests_benefit() -> None:
    doc = tuple(range(40))
    first, again = (TraceRequest(i, float(i), 512 * 40 + 60, 6, doc) for i in range(2))
    other = TraceRequest(2, 2.0, 512 * 40 + 60, 6, tuple(range(500, 540)))
    floors = idle_floors([first, again, other], PROFILE)
    assert floors[1] < floors[0] / 10  # the document is held: only the question is computed
    assert floors[2] == pytest.approx(floors[0], rel=0.01)  # a new document is computed whole
    # Arrival order decides what "earlier" means, not the order of the list.
    swapped = idle_floors([replace(again, arrival_s=0.0), replace(first, arrival_s=1.0)],
                          PROFILE)
    assert swapped[0] == pytest.approx(floors[0]) and swapped[1] == pytest.approx(floors[1])


def test_percentiles_are_keyed_as_the_routing_summaries() -> None:
    p = floor_percentiles([0.1 * i for i in range(1, 11)])
    assert set(p) == {"ttft_p50", "ttft_p90", "ttft_p99"}
    assert p["ttft_p50"] <= p["ttft_p90"] <= p["ttft_p99"] <= 1.0
