"""The expected-TTFT cost model: properties of the ranking, the estimate, holdings and rates."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT, estimate, queued_tokens
from proxy.core.errors import ConfigError
from proxy.core.holdings import ApproxHoldings
from proxy.core.rates import EngineRates, update_rates
from proxy.core.routeview import EngineView, RouteKey
from proxy.core.telemetry import parse_metrics

CFG = RoutingConfig()


def key(*chain: int, tokens: float = 0.0) -> RouteKey:
    return RouteKey(chain=tuple(chain), tenant="t", model="m", prompt_tokens=tokens)


@st.composite
def engine(draw: st.DrawFn, name: str) -> EngineView:
    running = float(draw(st.integers(0, 64)))
    waiting = float(draw(st.integers(0, 16)))
    pending = draw(st.integers(0, 8))
    seen = draw(st.integers(0, pending))
    since = draw(st.integers(0, 8))
    measured = draw(st.booleans())
    prefill = float(draw(st.integers(0, 40_000))) if pending else 0.0
    return EngineView(
        name=name, routable=draw(st.booleans()), fresh=draw(st.booleans()),
        load=running + waiting + since, kv_usage=draw(st.floats(0, 1)),
        prefill=prefill,
        running=running, waiting=waiting, pending=pending, pending_seen=seen,
        prefill_tps=draw(st.floats(1e3, 1e5)) if measured else None,
        step_s=draw(st.floats(0.005, 0.2)) if measured else None,
    )


@st.composite
def fleets(draw: st.DrawFn, min_size: int = 1) -> list[EngineView]:
    n = draw(st.integers(min_size, 8))
    return [draw(engine(f"e{i}")) for i in range(n)]


chains = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40, unique=True).map(tuple)


def held_by(policy: ExpectedTTFT, chain: tuple[int, ...], holds: dict[str, int]) -> None:
    """Let each engine hold the first ``holds[name]`` blocks of ``chain``."""
    for name, depth in holds.items():
        if depth:
            policy.observe(key(*chain[:depth]), name)


def idle(name: str, **kw: float) -> EngineView:
    return replace(EngineView(name, True, True, 0.0, 0.1), **kw)  # type: ignore[arg-type]


@settings(max_examples=300)
@given(fleets(), chains, st.data())
def test_never_picks_an_unroutable_engine(vs: list[EngineView], chain: tuple[int, ...],
                                          data: st.DataObject) -> None:
    policy = ExpectedTTFT(CFG)
    held_by(policy, chain, {v.name: data.draw(st.integers(0, len(chain))) for v in vs})
    ranked = policy.rank(key(*chain), vs)
    routable = {v.name for v in vs if v.routable}
    fresh = {v.name for v in vs if v.routable and v.fresh}
    # Stale engines are ranked only when no engine is fresh (then all routable ones, fail open).
    assert set(ranked) == (fresh or routable)


@given(chains, st.integers(2, 8), st.integers(1, 40), st.integers(0, 39))
def test_equal_state_prefers_the_engine_holding_more(chain: tuple[int, ...], n: int, more: int,
                                                     less: int) -> None:
    more = min(more, len(chain))
    less = min(less, more - 1)
    policy = ExpectedTTFT(CFG)
    holds = {f"e{i}": less for i in range(n)}
    holds["e1"] = more
    held_by(policy, chain, holds)
    assert policy.rank(key(*chain), [idle(f"e{i}") for i in range(n)])[0] == "e1"


@given(chains, st.integers(2, 8), st.integers(0, 40), st.integers(1, 30_000), st.data())
def test_equal_cache_prefers_the_less_loaded(chain: tuple[int, ...], n: int, depth: int,
                                             extra: int, data: st.DataObject) -> None:
    # Every engine holds the same; all but one carry ``extra`` more queued prompt work or
    # running sequences: the one with less goes first.
    policy = ExpectedTTFT(CFG)
    held_by(policy, chain, {f"e{i}": min(depth, len(chain)) for i in range(n)})
    light = data.draw(st.integers(0, n - 1))
    busy = data.draw(st.sampled_from(["prefill", "running"]))
    loaded = {"prefill": {"prefill": float(extra), "pending": 1, "load": 1.0},
              "running": {"running": float(extra % 200 + 1), "load": float(extra % 200 + 1)}}
    vs = [idle(f"e{i}") if i == light else idle(f"e{i}", **loaded[busy]) for i in range(n)]
    assert policy.rank(key(*chain), vs)[0] == f"e{light}"


@given(engine("e0"), st.integers(0, 20_000), st.integers(0, 64), st.integers(0, 16),
       st.floats(0, 50_000))
def test_estimate_is_monotone_in_queued_work(e: EngineView, prefill: int, running: int,
                                             waiting: int, held: float) -> None:
    k = key(1, 2, 3, tokens=5000.0)
    before = estimate(e, held, k, 1000.0, CFG)
    more = replace(e, prefill=e.prefill + prefill, pending=e.pending + (1 if prefill else 0),
                   running=e.running + running, waiting=e.waiting + waiting,
                   load=e.load + running + waiting + (1 if prefill else 0))
    after = estimate(more, held, k, 1000.0, CFG)
    assert after.wait_s >= before.wait_s - 1e-12
    assert after.ttft_s >= before.ttft_s - 1e-12
    assert estimate(e, held + 64, k, 1000.0, CFG).ttft_s <= before.ttft_s + 1e-12


@given(fleets(min_size=2), chains, st.integers(0, 7), st.integers(1, 50_000))
def test_adding_work_to_an_engine_never_makes_it_the_pick(
        vs: list[EngineView], chain: tuple[int, ...], which: int, extra: int) -> None:
    vs = [replace(v, routable=True, fresh=True) for v in vs]
    which %= len(vs)
    policy = ExpectedTTFT(CFG)
    if policy.rank(key(*chain), vs)[0] == vs[which].name:
        return
    heavier = list(vs)
    v = vs[which]
    heavier[which] = replace(v, prefill=v.prefill + extra, pending=v.pending + 1, load=v.load + 1)
    # A fresh policy: each ranking moves the pool's mean queue, which the second must not see.
    assert ExpectedTTFT(CFG).rank(key(*chain), heavier)[0] != v.name


@given(fleets(min_size=1), chains, st.booleans())
def test_no_reuse_reduces_to_least_load_among_the_least_waits(
        vs: list[EngineView], chain: tuple[int, ...], measured: bool) -> None:
    # Engines alike (the same rates, measured or the profile's) but for their queues.
    rates = {"prefill_tps": 8000.0, "step_s": 0.03} if measured else {
        "prefill_tps": None, "step_s": None}
    vs = [replace(v, routable=True, fresh=True, **rates) for v in vs]  # type: ignore[arg-type]
    # Without the charge for the streams a prefill stalls: the least wait, then the least load.
    plain = replace(CFG, decode_charge=0.0)
    policy = ExpectedTTFT(plain)  # nothing observed: no engine holds anything
    k = key(*chain)
    waits = {e.name: e.wait_s for e in policy.estimates(k, vs)}
    loads = {v.name: v.load for v in vs}
    pick = policy.rank(k, vs)[0]
    equal = [n for n, w in waits.items() if w <= min(waits.values()) * (1 + CFG.cost_tolerance)]
    assert pick in equal
    assert loads[pick] == min(loads[n] for n in equal)
    # With it: among the least costs, and the least wait once the streams' stall is counted.
    charged = ExpectedTTFT(CFG)
    costs = {e.name: e.cost_s for e in charged.estimates(k, vs)}
    assert costs[charged.rank(k, vs)[0]] <= min(costs.values()) * (1 + CFG.cost_tolerance)


def test_idle_queues_everywhere_go_to_the_least_loaded_engine() -> None:
    """No prefill queued anywhere and nothing held: the waits are one step everywhere, and the
    request joins the smallest decode batch (an engine at its sequence limit would make it wait
    for a slot), not the one its content's rendezvous order names."""
    vs = [replace(idle(n, load=load), running=load) for n, load in
          (("a", 30.0), ("b", 12.0), ("c", 31.0), ("d", 29.0))]
    for i in range(50):
        assert ExpectedTTFT(CFG).rank(key(1000 + i), vs)[0] == "b"


def test_all_stale_fails_open_least_loaded() -> None:
    vs = [replace(idle("a", load=3.0), fresh=False), replace(idle("b", load=1.0), fresh=False)]
    assert ExpectedTTFT(CFG).rank(key(1), vs) == ("b", "a")


def test_distinct_new_prompts_spread_over_an_idle_fleet() -> None:
    policy = ExpectedTTFT(CFG)
    vs = [idle(f"e{i}") for i in range(4)]
    picks = Counter(policy.rank(key(1000 + i, 2000 + i), vs)[0] for i in range(64))
    assert set(picks) == {"e0", "e1", "e2", "e3"}


def burst(policy: ExpectedTTFT, n_engines: int, n_requests: int, k: RouteKey) -> Counter[str]:
    """Requests with one key sent at once: no scrape in between, only this proxy's own counts."""
    vs = {f"e{i}": idle(f"e{i}") for i in range(n_engines)}
    picks: Counter[str] = Counter()
    for _ in range(n_requests):
        pick = policy.rank(k, list(vs.values()))[0]
        work = policy.uncached_tokens(k, pick)
        policy.observe(k, pick)
        v = vs[pick]
        vs[pick] = replace(v, prefill=v.prefill + work, pending=v.pending + 1, load=v.load + 1)
        picks[pick] += 1
    return picks


# The cost model with and without the abandoned charge (its default is on).
BOTH = pytest.mark.parametrize("charge", [True, False], ids=["charge", "plain"])


@BOTH
def test_a_burst_sharing_a_new_prefix_follows_its_first_request(charge: bool) -> None:
    # 8 requests, one new prefix of 1.5k words (~9000 characters, ~2250 tokens), 4 idle engines:
    # the first one's provisional entry draws the rest while the queue there stays within the
    # cost model's tolerance; then a second home opens, never all four.
    k = key(*range(1, 36), tokens=2260.0)
    picks = burst(ExpectedTTFT(replace(CFG, charge_abandoned=charge)), 4, 8, k)
    assert len(picks) <= 2, picks


@BOTH
def test_a_large_burst_spreads_over_the_fleet(charge: bool) -> None:
    # With the charge on, what the first request recorded is provisional (no first byte yet):
    # spreading is not charged for abandoning it, so the burst does not pile onto one engine.
    policy = ExpectedTTFT(replace(CFG, charge_abandoned=charge))
    picks = burst(policy, 4, 64, key(*range(1, 36), tokens=2260.0))
    assert set(picks) == {"e0", "e1", "e2", "e3"}
    assert max(picks.values()) <= 2 * min(picks.values()), picks


def test_the_abandoned_charge_is_on_by_default() -> None:
    assert RoutingConfig().charge_abandoned


def test_unknown_waiting_requests_count_at_the_mean_prompt() -> None:
    # Three waiting in the snapshot, one of them this proxy's (200 tokens); one more (300) since.
    e = idle("a", waiting=3.0, pending=2, pending_seen=1, prefill=500.0)
    assert queued_tokens(e, 1000.0) == 500.0 + 2 * 1000.0


def test_admitted_requests_queue_until_their_first_byte() -> None:
    # Four of this proxy's requests (400 tokens each) were in the snapshot, which reports one
    # waiting: the three admitted may still be prefilling in chunks, so all four count.
    e = idle("a", running=3.0, waiting=1.0, pending=4, pending_seen=4, prefill=1600.0, load=4.0)
    assert queued_tokens(e, 1000.0) == 1600.0


def test_holdings_count_tokens_and_forget() -> None:
    h = ApproxHoldings(100)
    k = RouteKey(chain=(1, 2, 3), prompt_tokens=250.0, block_tokens=64.0)
    h.record(RouteKey(chain=(1, 2)), "a")
    assert h.held_tokens(k, ["a", "b"]) == {"a": 128.0}
    h.forget("a")
    assert h.held_tokens(k, ["a"]) == {}
    # A prompt shorter than a block is its own one-block chain: held whole, never more.
    short = RouteKey(chain=(9,), prompt_tokens=10.0, block_tokens=64.0)
    h.record(short, "b")
    assert h.held_tokens(short, ["b"]) == {"b": 10.0}


def test_measured_rates_replace_the_profile_defaults() -> None:
    slow = idle("a", prefill_tps=1000.0, step_s=0.05)
    k = key(1, 2, tokens=1000.0)
    assert estimate(slow, 0.0, k, 1.0, CFG).ttft_s > estimate(idle("b"), 0.0, k, 1.0, CFG).ttft_s


_METRICS = """vllm:num_requests_running{{engine="0"}} 1
vllm:num_requests_waiting{{engine="0"}} 0
vllm:kv_cache_usage_perc{{engine="0"}} 0.1
vllm:request_prefill_kv_computed_tokens_sum{{engine="0"}} {tok}
vllm:request_prefill_kv_computed_tokens_count{{engine="0"}} 3
vllm:request_prefill_time_seconds_sum{{engine="0"}} {pre}
vllm:inter_token_latency_seconds_sum{{engine="0"}} {itl}
vllm:inter_token_latency_seconds_count{{engine="0"}} {n}
"""


def test_rates_from_vllm_histograms() -> None:
    a = parse_metrics(_METRICS.format(tok=1000, pre=0.5, itl=1.0, n=50), taken_at=0.0)
    b = parse_metrics(_METRICS.format(tok=5000, pre=0.9, itl=2.5, n=100), taken_at=0.2)
    rates = update_rates(EngineRates(), a, b)
    assert rates.prefill_tps == 10000.0 and rates.step_s == 0.03
    # A counter that went down (restart) and an interval without work give no sample.
    assert update_rates(rates, b, a) == rates
    assert update_rates(rates, b, b) == rates
    # Without the families (the simulator has no prefill histograms), nothing is measured.
    bare = parse_metrics('vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n'
                         'vllm:kv_cache_usage_perc 0\n', taken_at=0.0)
    assert bare.prefill_tokens_sum is None
    assert update_rates(EngineRates(), bare, bare) == EngineRates()


def test_under_load_a_conversation_keeps_the_engine_holding_its_history() -> None:
    # e0 holds a 3000-token history; it has 6000 tokens of prompt work queued, e1 none. On a pool
    # that reports no queues, recomputing the history on e1 is faster for this request; once the
    # engines report queues, that recompute would delay the requests queued behind it, so the
    # conversation stays.
    history = key(*range(1, 48), tokens=3000.0)
    turn = key(*range(1, 50), tokens=3150.0)
    busy = idle("e0", prefill=6000.0, pending=1, load=1.0)
    policy = ExpectedTTFT(CFG)
    policy.observe(history, "e0")
    assert policy.rank(turn, [busy, idle("e1")])[0] == "e1"
    loaded = [replace(busy, waiting=3.0, load=4.0), idle("e1", waiting=3.0, load=3.0)]
    for _ in range(200):  # the pool's mean queue, as reported, settles at 3
        policy.rank(key(7), loaded)
    # The same difference in queued work as before (both report three waiting).
    assert policy.rank(turn, loaded)[0] == "e0"


def test_a_document_longer_than_32k_tokens_stays_on_the_engine_holding_it() -> None:
    """The prompt's whole chain is hashed by default: its home counts all of it as held, and a
    queue there shorter than recomputing the document elsewhere keeps it home (a 512-block cap
    counted the 17k tokens past 32k as uncached at home too and moved it to the idle engine)."""
    from proxy.core.prefix import prefix_chain  # noqa: PLC0415

    doc = "".join(f"{i:07d} " for i in range(25_000))  # 200k characters: about 50k tokens

    def doc_key(question: str) -> RouteKey:
        text = doc + question
        chain = prefix_chain(text, model="m", tenant="t", block_chars=CFG.block_chars,
                             max_blocks=CFG.max_blocks)
        return RouteKey(chain=chain, tenant="t", model="m",
                        prompt_tokens=len(text) / CFG.chars_per_token,
                        block_tokens=CFG.block_chars / CFG.chars_per_token)

    policy = ExpectedTTFT(CFG)
    policy.observe(doc_key("first question?"), "home")
    # 40k prompt tokens of another request queued at home: 3.3 s, less than the 4.2 s of
    # computing the document on the idle engine.
    home = idle("home", load=1.0, prefill=40_000.0, pending=1)
    assert policy.rank(doc_key("second question?"), [home, idle("other")])[0] == "home"


def test_charging_the_abandoned_cache_keeps_a_conversation_home_longer() -> None:
    # e0 holds a 3000-token history it has computed (its request had its first byte) and has
    # 5000 tokens of prompt work queued, e1 none, on a pool that reports no queues. The plain
    # model moves the turn for a small gain (0.46 s against 0.29 s); charged the history's
    # prefill once more, e1 costs 0.55 s and the turn stays. A queue at home longer than twice
    # the history still moves it.
    history = key(*range(1, 48), tokens=3000.0)
    turn = key(*range(1, 50), tokens=3150.0)
    for queued, plain, charged in ((5000.0, "e1", "e0"), (20_000.0, "e1", "e1")):
        fleet = [idle("e0", prefill=queued, pending=1, load=1.0), idle("e1")]
        picks = []
        for cfg in (replace(CFG, charge_abandoned=False), replace(CFG, charge_abandoned=True)):
            policy = ExpectedTTFT(cfg)
            policy.dispatched("history", history, "e0")
            policy.first_byte("history", "e0")
            picks.append(policy.rank(turn, fleet)[0])
        assert picks == [plain, charged]


def test_only_a_settled_history_is_charged_for_leaving() -> None:
    # The same history only sent to e0 (no first byte yet: provisional) is not charged: the
    # turn moves as in the plain model. Once its first byte has come, it stays.
    history = key(*range(1, 48), tokens=3000.0)
    turn = key(*range(1, 50), tokens=3150.0)
    fleet = [idle("e0", prefill=5000.0, pending=1, load=1.0), idle("e1")]
    policy = ExpectedTTFT(replace(CFG, charge_abandoned=True))
    policy.dispatched(1, history, "e0")
    assert policy.rank(turn, fleet)[0] == "e1"
    policy.first_byte(1, "e0")
    assert policy.rank(turn, fleet)[0] == "e0"


@given(engine("e"), st.floats(0.0, 50_000.0))
def test_the_abandoned_charge_only_adds_cost(e: EngineView, abandoned: float) -> None:
    k = key(1, 2, 3, tokens=60_000.0)
    plain = estimate(e, 0.0, k, 1000.0, CFG, delayed=2.0)
    charged = estimate(e, 0.0, k, 1000.0, CFG, delayed=2.0, abandoned=abandoned)
    assert charged.cost_s >= plain.cost_s
    assert (charged.wait_s, charged.ttft_s) == (plain.wait_s, plain.ttft_s)


def test_a_long_new_prompt_goes_where_it_stalls_no_stream() -> None:
    # Idle prefill queues everywhere; a holds the tenant's 1,000-token system prompt and decodes
    # 4 streams, b holds nothing and decodes none. A new 9,000-token document prompt: the plain
    # model takes a (1,000 tokens less to compute); charged for the 8,000 tokens' stall of a's
    # four streams (0.27 s at the default share), b is cheaper by more than the tolerance. The
    # question after it, whose prompt a holds but 30 tokens, stays on a: stalling four streams
    # for 30 tokens costs less than computing 9,000 elsewhere.
    system = key(*range(1, 17), tokens=1000.0)
    document = key(*range(1, 145), tokens=9000.0)
    question = key(*range(1, 146), tokens=9030.0)
    fleet = [idle("a", running=4.0, load=4.0), idle("b")]
    picks = {}
    for charge in (0.0, CFG.decode_charge):
        policy = ExpectedTTFT(replace(CFG, decode_charge=charge))
        policy.observe(system, "a")
        picks[charge] = policy.rank(document, fleet)[0]
        policy.observe(document, "a")
        assert policy.rank(question, fleet)[0] == "a"
    assert picks == {0.0: "a", CFG.decode_charge: "b"}


@given(engine("e"), st.integers(0, 64), st.floats(0.0, 50_000.0), st.floats(0.0, 4.0))
def test_the_decode_charge_only_adds_cost_and_grows_with_the_streams_stalled(
        e: EngineView, more: int, held: float, charge: float) -> None:
    k = key(1, 2, 3, tokens=20_000.0)
    cfg = replace(CFG, decode_charge=charge)
    plain = estimate(e, held, k, 1000.0, replace(CFG, decode_charge=0.0), delayed=2.0)
    charged = estimate(e, held, k, 1000.0, cfg, delayed=2.0)
    busier = estimate(replace(e, running=e.running + more, load=e.load + more), held, k, 1000.0,
                      cfg, delayed=2.0)
    assert charged.cost_s >= plain.cost_s
    assert (charged.wait_s, charged.ttft_s) == (plain.wait_s, plain.ttft_s)
    assert busier.cost_s - busier.wait_s >= charged.cost_s - charged.wait_s - 1e-9
    # A prompt the engine holds whole stalls nothing there.
    whole = estimate(e, 20_000.0, k, 1000.0, cfg, delayed=2.0)
    assert whole.cost_s == estimate(e, 20_000.0, k, 1000.0, replace(CFG, decode_charge=0.0),
                                    delayed=2.0).cost_s


def test_the_decode_charge_is_on_by_default_and_bounded() -> None:
    assert 0.0 < RoutingConfig().decode_charge <= 1.0
    with pytest.raises(ConfigError, match="decode_charge"):
        RoutingConfig(decode_charge=-0.1)
