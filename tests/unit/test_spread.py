"""Spreading the picks of replicas that rank on one shared view (``proxy.core.spread``)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.routeview import EngineView, RouteKey
from proxy.core.spread import Blindness, spread_pick

CFG = RoutingConfig()
PROMPT = 8000.0


@st.composite
def engine(draw: st.DrawFn, name: str) -> EngineView:
    running = float(draw(st.integers(0, 64)))
    waiting = float(draw(st.integers(0, 16)))
    pending = draw(st.integers(0, 8))
    return EngineView(
        name=name, routable=draw(st.booleans()), fresh=draw(st.booleans()),
        load=running + waiting, kv_usage=draw(st.floats(0, 1)),
        prefill=float(draw(st.integers(0, 40_000))) if pending else 0.0,
        running=running, waiting=waiting, pending=pending,
        pending_seen=draw(st.integers(0, pending)))


@st.composite
def fleets(draw: st.DrawFn) -> list[EngineView]:
    return [draw(engine(f"e{i}")) for i in range(draw(st.integers(1, 8)))]


chains = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40, unique=True).map(tuple)


def idle(name: str, prefill: float = 0.0, pending: int = 0) -> EngineView:
    return EngineView(name, True, True, float(pending), 0.1, prefill=prefill, pending=pending)


def key(chain: tuple[int, ...], unseen: float = 0.0, draw: float = 0.0) -> RouteKey:
    return RouteKey(chain=chain, tenant="t", model="m", prompt_tokens=PROMPT, unseen=unseen,
                    draw=draw)


@settings(max_examples=200)
@given(fleets(), chains, st.floats(0.0, 1.0, exclude_max=True))
def test_nothing_unseen_leaves_the_ranking_unchanged(vs: list[EngineView], chain: tuple[int, ...],
                                                     draw: float) -> None:
    plain, drawn = ExpectedTTFT(CFG), ExpectedTTFT(CFG)
    assert drawn.rank(key(chain, 0.0, draw), vs) == plain.rank(key(chain), vs)


@settings(max_examples=200)
@given(fleets(), chains, st.floats(0.0, 50.0), st.floats(0.0, 1.0, exclude_max=True))
def test_a_spread_ranking_is_a_permutation_of_the_plain_one(
        vs: list[EngineView], chain: tuple[int, ...], unseen: float, draw: float) -> None:
    plain, drawn = ExpectedTTFT(CFG), ExpectedTTFT(CFG)
    ranked, spread = plain.rank(key(chain), vs), drawn.rank(key(chain, unseen, draw), vs)
    assert sorted(spread) == sorted(ranked)
    assert spread[1:] == tuple(n for n in ranked if n != spread[0])


def test_one_process_expects_nothing_unseen() -> None:
    alone = Blindness()
    assert alone.unseen() == 0.0  # no round merged yet: nothing shared
    for _ in range(40):
        alone.merged(peers=0, dispatches=5)
        assert alone.unseen() == 0.0


def test_a_decision_expects_what_the_two_merges_after_it_held() -> None:
    blind = Blindness()
    blind.merged(peers=3, dispatches=0)
    for _ in range(200):  # each decision followed by merges of 6 and 3 peer dispatches
        blind.unseen()
        blind.merged(peers=3, dispatches=6)
        blind.merged(peers=3, dispatches=3)
    assert abs(blind.unseen() - 9.0) < 1e-3
    for _ in range(200):  # a merge with nothing in it between decisions: rounds idle
        blind.unseen()
        blind.merged(peers=3, dispatches=0)
        blind.merged(peers=3, dispatches=0)
    assert blind.unseen() < 1e-3


def test_losing_the_peers_stops_the_spread_at_once() -> None:
    blind = Blindness()
    for _ in range(50):
        blind.merged(peers=1, dispatches=4)
        blind.unseen()
    assert blind.unseen() > 1.0
    blind.merged(peers=0, dispatches=0)
    assert blind.unseen() == 0.0


def test_the_engine_holding_the_prompt_keeps_it_whatever_the_draw() -> None:
    policy = ExpectedTTFT(CFG)
    chain = tuple(range(100, 220))  # 120 blocks of 64 tokens: the whole prompt
    policy.observe(RouteKey(chain=chain, prompt_tokens=PROMPT), "e1")
    vs = [idle(f"e{i}") for i in range(4)]
    picks = {policy.rank(key(chain, 6.0, d / 20), vs)[0] for d in range(20)}
    assert picks == {"e1"}


def test_places_fill_the_cheapest_engines_as_one_router_would() -> None:
    class E:
        def __init__(self, name: str, cost_s: float) -> None:
            self.name, self.cost_s, self.held = name, cost_s, 0.0

    est = [E("a", 1.0), E("b", 1.5), E("c", 3.0)]
    step = {"a": 1.0, "b": 1.0, "c": 1.0}
    # a (1.0) first; then b (1.5) < a (2.0); then a (2.0) < b (2.5): places a, b, a.
    picks = Counter(spread_pick(["a", "b", "c"], est, step, unseen=2.0, draw=d / 30,
                                held_slack=64.0)[0] for d in range(30))
    assert picks == Counter({"a": 20, "b": 10})


def _burst(policies: list[ExpectedTTFT], blinds: list[Blindness], rng: random.Random,
           now: float, chains_: list[tuple[int, ...]]) -> Counter[str]:
    """A burst of requests at one instant, in turn over replicas that see the same busy fleet
    (each engine a little more prompt work queued than the one before) and, each, only their own
    dispatches of the burst."""
    fleet = [idle(f"e{i}", prefill=2000.0 * i, pending=i) for i in range(8)]
    views = [list(fleet) for _ in policies]
    got: Counter[str] = Counter()
    for i, chain in enumerate(chains_):
        r = i % len(policies)
        unseen = blinds[r].unseen()
        pick = policies[r].rank(key(chain, unseen, rng.random() if unseen else 0.0), views[r])[0]
        policies[r].observe(key(chain), pick)
        views[r] = [replace(v, prefill=v.prefill + PROMPT, pending=v.pending + 1)
                    if v.name == pick else v for v in views[r]]
        got[pick] += 1
    return got


def _doubled_per_burst(spread: bool, *, replicas: int, size: int) -> list[int]:
    policies = [ExpectedTTFT(CFG) for _ in range(replicas)]
    blinds = [Blindness() for _ in range(replicas)]
    rng, worst = random.Random(7), []
    for b in range(40):
        now = float(b)
        for blind in blinds:  # the last burst's dispatches, merged in two rounds
            blind.merged(replicas - 1 if spread else 0, size - size // replicas)
            blind.merged(replicas - 1 if spread else 0, 0)
        chains_ = [(7, i, b) for i in range(size)]
        got = _burst(policies, blinds, rng, now, chains_)
        worst.append(sum(n * (n - 1) // 2 for n in got.values()))
    return worst


def test_replicas_on_one_view_no_longer_send_a_burst_to_the_same_engines() -> None:
    # Pairs of a burst's requests sent to the same engine. Without spreading the replicas rank
    # the fleet alike: each one's first request of a burst of four goes to the least busy
    # engine (6 pairs), or, with two replicas, two by two to the two least busy (2 pairs).
    assert _doubled_per_burst(False, replicas=4, size=4) == [6] * 40
    assert _doubled_per_burst(False, replicas=2, size=4) == [2] * 40
    # With it, once the bursts show in what a decision expects, far fewer.
    four = _doubled_per_burst(True, replicas=4, size=4)[10:]
    two = _doubled_per_burst(True, replicas=2, size=4)[10:]
    assert sum(four) <= 0.5 * 6 * len(four)
    assert sum(two) <= 0.75 * 2 * len(two)




