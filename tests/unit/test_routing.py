import math
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.prefix import canonical_chat, prefix_chain
from proxy.core.routing import (
    BlockIndex,
    EngineView,
    LeastLoad,
    PrefixAffinity,
    RoundRobin,
    RouteKey,
    candidates,
    common_depth,
    load_bound,
    make_policy,
)

# Spill tests need a bound that binds on small pools (with n engines, only load_factor < n can).
CFG = RoutingConfig(load_factor=1.25)


def view(
    name: str, load: float = 0.0, *, routable: bool = True, fresh: bool = True, kv: float = 0.1
) -> EngineView:
    return EngineView(name=name, routable=routable, fresh=fresh, load=load, kv_usage=kv)


def fleet(n: int, load: float = 0.0) -> list[EngineView]:
    return [view(f"e{i}", load) for i in range(n)]


def key(*chain: int) -> RouteKey:
    return RouteKey(chain=tuple(chain), tenant="t", model="m")


@st.composite
def views(draw: st.DrawFn, min_size: int = 1) -> list[EngineView]:
    n = draw(st.integers(min_value=min_size, max_value=8))
    return [
        view(
            f"e{i}",
            draw(st.integers(0, 30)),
            routable=draw(st.booleans()),
            fresh=draw(st.booleans()),
            kv=draw(st.floats(0, 1)),
        )
        for i in range(n)
    ]


chains = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6).map(tuple)
policy_names = st.sampled_from(["round_robin", "least_load", "prefix_affinity", "expected_ttft"])


def test_make_policy() -> None:
    assert isinstance(make_policy(RoutingConfig(policy="round_robin")), RoundRobin)
    assert isinstance(make_policy(RoutingConfig(policy="least_load")), LeastLoad)
    assert isinstance(make_policy(RoutingConfig(policy="prefix_affinity")), PrefixAffinity)
    assert isinstance(make_policy(RoutingConfig()), ExpectedTTFT)
    for name in ("round_robin", "least_load", "prefix_affinity", "expected_ttft"):
        assert make_policy(RoutingConfig(policy=name)).name == name


# --- properties shared by every policy -----------------------------------------------------------


@given(policy_names, chains, views())
def test_only_routable_and_fresh_first(
    name: str, chain: tuple[int, ...], vs: list[EngineView]
) -> None:
    ranked = make_policy(RoutingConfig(policy=name)).rank(RouteKey(chain), vs)
    by_name = {v.name: v for v in vs}
    assert len(set(ranked)) == len(ranked)
    assert all(by_name[n].routable for n in ranked)
    assert len(ranked) == len(candidates(vs)[0])
    if any(v.routable and v.fresh for v in vs):
        # Stale engines only when no engine is fresh: never the pick, never the retry target.
        assert all(by_name[n].fresh for n in ranked)
    elif any(v.routable for v in vs):
        # All stale: fail open, least loaded first.
        assert [by_name[n].load for n in ranked] == sorted(by_name[n].load for n in ranked)
    else:
        assert ranked == ()


@given(policy_names, st.lists(st.tuples(chains, views()), max_size=10))
def test_deterministic(name: str, calls: list[tuple[tuple[int, ...], list[EngineView]]]) -> None:
    # Two replicas that see the same sequence decide the same way.
    a, b = make_policy(RoutingConfig(policy=name)), make_policy(RoutingConfig(policy=name))
    for chain, vs in calls:
        ra, rb = a.rank(RouteKey(chain), vs), b.rank(RouteKey(chain), vs)
        assert ra == rb
        if ra:
            a.observe(RouteKey(chain), ra[0])
            b.observe(RouteKey(chain), rb[0])


# --- prefix affinity -----------------------------------------------------------------------------


@given(chains, views(), st.sampled_from([1.0, 1.25, 1.5, 2.0]))
def test_load_bound(chain: tuple[int, ...], vs: list[EngineView], factor: float) -> None:
    policy = PrefixAffinity(RoutingConfig(load_factor=factor))
    ranked = policy.rank(RouteKey(chain), vs)
    cands, stale_only = candidates(vs)
    if not ranked or stale_only:
        return
    by_name = {v.name: v for v in vs}
    floor = policy.cfg.min_load_bound
    bound = max(floor, math.ceil(factor * (sum(v.load for v in cands) + 1) / len(cands)))
    assert bound == load_bound(cands, factor, floor)
    # With whole-number loads some engine always fits (Mirrokni et al.), so the pick does.
    assert by_name[ranked[0]].load + 1 <= bound


@given(chains, st.integers(2, 8))
def test_stable_spill_when_home_removed(chain: tuple[int, ...], n: int) -> None:
    policy = PrefixAffinity(CFG)
    vs = fleet(n)
    ranked = policy.rank(RouteKey(chain), vs)
    without = [v for v in vs if v.name != ranked[0]]
    assert policy.rank(RouteKey(chain), without) == ranked[1:]


@given(chains, st.integers(2, 8))
def test_stable_spill_when_home_overloaded(chain: tuple[int, ...], n: int) -> None:
    policy = PrefixAffinity(CFG)
    vs = fleet(n, load=2)
    ranked = policy.rank(RouteKey(chain), vs)
    hot = [view(v.name, 100 * n if v.name == ranked[0] else 2) for v in vs]
    spilled = policy.rank(RouteKey(chain), hot)
    assert spilled[0] == ranked[1]
    assert spilled[-1] == ranked[0]  # still ranked, last resort


@given(st.lists(chains, min_size=1, max_size=30, unique=True), st.integers(3, 8))
def test_other_keys_unaffected(keys: list[tuple[int, ...]], n: int) -> None:
    policy = PrefixAffinity(CFG)
    vs = fleet(n)
    homes = {k: policy.rank(RouteKey(k), vs)[0] for k in keys}
    gone = "e0"
    without = [v for v in vs if v.name != gone]
    hot = [view(v.name, 10 * n if v.name == gone else 0) for v in vs]
    for k, home in homes.items():
        if home != gone:
            assert policy.rank(RouteKey(k), without)[0] == home
            assert policy.rank(RouteKey(k), hot)[0] == home


def test_same_prefix_same_home_distinct_spread() -> None:
    policy = PrefixAffinity(CFG)
    vs = fleet(4)
    assert len({policy.rank(key(1, 2, 3, i), vs)[0] for i in range(20)}) == 1
    homes = Counter(policy.rank(key(i, i + 1), vs)[0] for i in range(400))
    assert set(homes) == {"e0", "e1", "e2", "e3"}
    assert max(homes.values()) < 2 * 400 / 4


def test_shared_first_block_still_spreads_without_index() -> None:
    # Every request shares block 0 (as in real conversation traces); the key covers two blocks.
    policy = PrefixAffinity(RoutingConfig(index_blocks=0))
    vs = fleet(8)
    homes = Counter(policy.rank(key(7, i, i + 1), vs)[0] for i in range(400))
    assert len(homes) == 8


def test_seed_changes_order() -> None:
    vs = fleet(8)
    a, b = PrefixAffinity(RoutingConfig(seed=0)), PrefixAffinity(RoutingConfig(seed=1))
    assert any(a.rank(key(i, i), vs)[0] != b.rank(key(i, i), vs)[0] for i in range(50))


def test_conversation_keeps_its_engine() -> None:
    policy = PrefixAffinity(CFG)
    vs = fleet(8)
    moved = 0
    for conv in range(50):
        turn = [10**6 + conv]
        home = None
        for block in range(6):
            turn.append(conv * 100 + block)
            pick = policy.rank(key(*turn), vs)[0]
            policy.observe(key(*turn), pick)
            home = home or pick
            moved += pick != home
    assert moved == 0


def test_index_follows_a_spilled_conversation() -> None:
    # Turn 1 spills off its rendezvous home; turn 2 goes where turn 1's prefix is, not home.
    policy = PrefixAffinity(CFG)
    vs = fleet(4)
    turn1 = key(5, 6, 7)
    home = policy.rank(turn1, vs)[0]
    busy = [view(v.name, 20 if v.name == home else 0) for v in vs]
    second = policy.rank(turn1, busy)[0]
    policy.observe(turn1, second)
    assert policy.rank(key(5, 6, 7, 8, 9), vs)[0] == second


def test_shared_system_prompt_spreads_once_everywhere() -> None:
    policy = PrefixAffinity(CFG)
    vs = fleet(4)
    system = (11, 12, 13)
    for v in vs:
        policy.observe(key(*system), v.name)
    homes = Counter(policy.rank(key(*system, i, i + 1), vs)[0] for i in range(400))
    assert len(homes) == 4


@pytest.mark.parametrize("place_new", ["prefill", "least_load", "rendezvous"])
def test_shared_system_prompt_spreads_under_load(place_new: str) -> None:
    # No request is answered meanwhile: loads and prefill backlogs only grow.
    policy = PrefixAffinity(RoutingConfig(load_factor=1.25, place_new=place_new))
    loads = dict.fromkeys((f"e{i}" for i in range(4)), 0)
    backlog = dict.fromkeys(loads, 0.0)
    for i in range(200):
        k = key(11, 12, 13, i)
        vs = [EngineView(n, True, True, load, 0.1, prefill=backlog[n]) for n, load in loads.items()]
        pick = policy.rank(k, vs)[0]
        backlog[pick] += policy.uncached_tokens(k, pick)
        policy.observe(k, pick)
        loads[pick] += 1
    assert max(loads.values()) <= math.ceil(1.25 * 200 / 4)
    assert min(loads.values()) > 0


def test_kv_usage_breaks_least_load_ties() -> None:
    vs = [view("a", 1, kv=0.9), view("b", 1, kv=0.2), view("c", 3, kv=0.0)]
    assert LeastLoad().rank(key(1), vs) == ("b", "a", "c")


def test_round_robin_cycles() -> None:
    rr = RoundRobin()
    vs = fleet(3)
    picks = [rr.rank(key(1), vs)[0] for _ in range(6)]
    assert picks == ["e0", "e1", "e2", "e0", "e1", "e2"]
    assert rr.rank(key(1), []) == ()


# --- the block index -----------------------------------------------------------------------------


def test_block_index_longest_match_and_bound() -> None:
    index = BlockIndex(capacity=5)
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2, 3, 4])
    assert index.match_depths([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": 3, "b": 4}
    index.add("a", [9, 8, 7])
    assert index.size("a") == 5  # bounded; the deepest, least recent blocks go first
    assert index.match_depths([1, 2, 3], ["a"]) == {"a": 2}
    index.add("a", [20, 21])
    assert index.match_depths([1, 2, 3], ["a"]) == {}
    index.forget("b")
    assert index.match_depths([1, 2, 3, 4], ["b"]) == {}
    disabled = BlockIndex(capacity=0)
    disabled.add("a", [1])
    assert disabled.size("a") == 0


@settings(max_examples=50)
@given(st.lists(st.tuples(chains, st.sampled_from(["a", "b", "c"])), max_size=60))
def test_block_index_stays_bounded(obs: Sequence[tuple[tuple[int, ...], str]]) -> None:
    index = BlockIndex(capacity=8)
    for chain, engine in obs:
        index.add(engine, chain)
        assert index.size(engine) <= 8


@pytest.mark.parametrize("n", [1, 2, 8])
def test_single_request_idle_fleet(n: int) -> None:
    ranked = PrefixAffinity(CFG).rank(key(3), fleet(n))
    assert len(ranked) == n


def test_idle_pool_does_not_spill() -> None:
    # One request in flight over three engines: the plain mean bound is 1, which would move the
    # next request with the same prefix away from its home; the floor keeps it there.
    for cfg, stays in ((RoutingConfig(load_factor=1.25), True),
                       (RoutingConfig(load_factor=1.25, min_load_bound=1), False)):
        policy = PrefixAffinity(cfg)
        home = policy.rank(key(1, 2), [view("a", 0), view("b", 0), view("c", 0)])[0]
        policy.observe(key(1, 2), home)
        vs = [view(n, 1 if n == home else 0) for n in ("a", "b", "c")]
        assert load_bound(vs, 1.25) == 1
        assert (policy.rank(key(1, 2, 3), vs)[0] == home) is stays


def test_nothing_fits_takes_least_loaded() -> None:
    # Fractional loads (never from real gauges) can put every engine over the bound.
    vs = [view("a", 0.9, kv=0.5), view("b", 0.9, kv=0.1)]
    policy = PrefixAffinity(RoutingConfig(load_factor=1.0))
    assert load_bound(vs, 1.0) == 2
    vs = [view("a", 1.5, kv=0.5), view("b", 1.5, kv=0.1)]
    assert load_bound(vs, 1.0) == 2
    assert policy.rank(key(1, 2), vs) == ("b", "a")


def test_new_conversation_goes_to_the_least_prefill_backlog() -> None:
    # Nothing but the shared system prompt is known: the engine with the least prompt work ahead
    # of the request takes it, whatever its request count; the next turn follows it there.
    policy = PrefixAffinity(RoutingConfig())
    system = (11, 12, 13)
    for i in range(3):
        policy.observe(key(*system), f"e{i}")  # e3 lacks even the system prompt
    vs = [EngineView(n, True, True, load, 0.1, prefill=p * 64)
          for n, load, p in (("e0", 1, 40.0), ("e1", 3, 2.0), ("e2", 2, 9.0), ("e3", 0, 0.0))]
    first = key(*system, 40, 41)
    # e1: 2 + 2 blocks to prefill; e3: 0 + 5; e2: 9 + 2; e0: 40 + 2.
    assert policy.rank(first, vs) == ("e1", "e3", "e2", "e0")
    assert policy.uncached(first, "e1") == 2 and policy.uncached(first, "e3") == 5
    policy.observe(first, "e1")
    vs = [EngineView(v.name, True, True, v.load, 0.1, prefill=0.0 if v.name == "e3" else 50.0)
          for v in vs]
    assert policy.rank(key(*system, 40, 41, 42), vs)[0] == "e1"


def test_new_conversation_goes_to_the_least_loaded_engine() -> None:
    # Only the shared system prompt (held everywhere) is known: nothing to gain from any engine's
    # cache, so load decides; its next turn then follows it although that engine is now busier.
    policy = PrefixAffinity(RoutingConfig(place_new="least_load"))
    system = (11, 12, 13)
    for i in range(4):
        policy.observe(key(*system), f"e{i}")
    vs = [view("e0", 3), view("e1", 1), view("e2", 2), view("e3", 3)]
    first = key(*system, 40, 41)
    assert policy.rank(first, vs)[0] == "e1"
    policy.observe(first, "e1")
    busier = [view("e0", 3), view("e1", 4), view("e2", 2), view("e3", 3)]
    assert policy.rank(key(*system, 40, 41, 42), busier)[0] == "e1"


def test_rendezvous_placement_ignores_load_within_the_bound() -> None:
    policy = PrefixAffinity(RoutingConfig(place_new="rendezvous"))
    idle = fleet(4)
    home = policy.rank(key(5, 6), idle)[0]
    vs = [view(v.name, 1 if v.name == home else 0) for v in idle]
    assert policy.rank(key(5, 6), vs)[0] == home
    assert PrefixAffinity(CFG).rank(key(5, 6), vs)[0] != home


def test_common_depth() -> None:
    assert common_depth({}, 4) == 0
    assert common_depth({"a": 5}, 4) == 0  # one engine is never "most"
    assert common_depth({"a": 5, "b": 3}, 4) == 3
    assert common_depth({"a": 5, "b": 3, "c": 1}, 8) == 0
    assert common_depth({"a": 5, "b": 3, "c": 2, "d": 2}, 8) == 2
    assert common_depth({"a": 5, "b": 3}, 2) == 3


def test_prefix_most_engines_hold_does_not_attract() -> None:
    # Held by three of four engines: common, so the request's own next block decides.
    # By default the engine lacking it is not picked while the others are idle: it would have to
    # compute the shared prefix too.
    for place_new, spread in (("prefill", 3), ("least_load", 4), ("rendezvous", 4)):
        policy = PrefixAffinity(RoutingConfig(place_new=place_new))
        vs = fleet(4)
        for name in ("e0", "e1", "e2"):
            policy.observe(key(11, 12, 13), name)
        homes = Counter(policy.rank(key(11, 12, 13, i), vs)[0] for i in range(400))
        assert len(homes) == spread
        assert max(homes.values()) < 2 * 400 / spread


small_chains = st.lists(st.integers(0, 5), min_size=1, max_size=5).map(tuple)


@given(
    st.lists(st.tuples(small_chains, st.integers(0, 7)), max_size=30),
    small_chains,
    st.integers(2, 8),
)
def test_stable_spill_with_history(
    history: list[tuple[tuple[int, ...], int]], chain: tuple[int, ...], n: int
) -> None:
    # Whatever the index has learnt, an overloaded home hands its keys to the second choice.
    policy = PrefixAffinity(CFG)
    for past, engine in history:
        policy.observe(RouteKey(past), f"e{engine % n}")
    vs = fleet(n, load=2)
    ranked = policy.rank(RouteKey(chain), vs)
    hot = [view(v.name, 100 * n if v.name == ranked[0] else 2) for v in vs]
    assert policy.rank(RouteKey(chain), hot)[0] == ranked[1]


def test_short_growing_conversations_stay_on_their_engine() -> None:
    # Real chat: each turn appends an answer and a question of a few hundred characters, so the
    # block boundaries of one turn fall inside the next turn's text. From its second turn on, a
    # conversation must keep its engine (idle fleet, so the load bound never forces a spill).
    cfg = RoutingConfig()
    policy = PrefixAffinity(cfg)
    engines = [view(n, 0) for n in ("e0", "e1", "e2", "e3")]
    words = [f"w{i * 7919 % 1000}" for i in range(400)]
    moves = 0
    for conv in range(50):
        msgs: list[dict[str, object]] = [{"role": "system", "content": "You are helpful."}]
        picks: list[str] = []
        for turn in range(6):
            start = (conv * 31 + turn * 17) % 300
            msgs.append({"role": "user", "content": " ".join(words[start : start + 20])})
            text = canonical_chat(msgs)
            rk = RouteKey(
                prefix_chain(text, model="m", tenant="t", block_chars=cfg.block_chars,
                             max_blocks=cfg.max_blocks)
            )
            picks.append(policy.rank(rk, engines)[0])
            policy.observe(rk, picks[-1])
            msgs.append({"role": "assistant", "content": " ".join(words[start + 20 : start + 60])})
        assert len(text) < 2400  # short chats: a few hundred characters a turn
        moves += sum(p != picks[1] for p in picks[2:])
    assert moves == 0


def test_forgotten_engine_attracts_nothing() -> None:
    policy = PrefixAffinity(CFG)
    policy.observe(key(1, 2, 3), "e1")
    assert policy.uncached(key(1, 2, 3, 4), "e1") == 1
    policy.forget("e1")
    assert policy.uncached(key(1, 2, 3, 4), "e1") == 4
    assert policy.index.size("e1") == 0
