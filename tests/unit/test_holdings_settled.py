"""Settled holdings: what an engine is known to have computed, next to what was only sent there
(the bound on the cost model's abandoned charge)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.blockhash import PLAIN_ROOT, chain_keys
from proxy.core.config import RoutingConfig
from proxy.core.costmodel import MAX_UNCONFIRMED, ExpectedTTFT
from proxy.core.exact_holdings import PreciseHoldings
from proxy.core.holdings import ApproxHoldings
from proxy.core.kvindex import Batch, ExactIndex, Stored
from proxy.core.routeview import RouteKey

ENGINES = ("e0", "e1", "e2")

# Chains that share prefixes, as conversations do: a root block, then a branch of some depth.
chains = st.builds(lambda root, branch, depth: (root, *(branch * 100 + i for i in range(depth))),
                   st.integers(1, 3), st.integers(1, 4), st.integers(0, 12))
ops = st.lists(st.tuples(st.sampled_from(("record", "confirm", "forget")), chains,
                         st.sampled_from(ENGINES)), max_size=60)


def key(chain: tuple[int, ...]) -> RouteKey:
    return RouteKey(chain=chain, prompt_tokens=len(chain) * 64.0)


def run(holdings: ApproxHoldings, steps: list[tuple[str, tuple[int, ...], str]]) -> None:
    for op, chain, engine in steps:
        if op == "record":
            holdings.record(key(chain), engine)
        elif op == "confirm":
            holdings.confirm(key(chain), engine)
        else:
            holdings.forget(engine)


@settings(max_examples=300)
@given(ops, chains, st.integers(1, 16))
def test_settled_never_exceeds_held_and_memory_stays_bounded(
        steps: list[tuple[str, tuple[int, ...], str]], probe: tuple[int, ...],
        capacity: int) -> None:
    holdings = ApproxHoldings(capacity)
    run(holdings, steps)
    held = holdings.held_tokens(key(probe), ENGINES)
    for engine, tokens in holdings.settled_tokens(key(probe), ENGINES).items():
        assert 0.0 < tokens <= held[engine]
    for engine in ENGINES:
        assert holdings.settled.size(engine) <= capacity
        assert holdings.index.size(engine) <= capacity


@settings(max_examples=200)
@given(ops, chains, st.sampled_from(ENGINES))
def test_confirming_a_chain_never_recorded_there_changes_nothing_held(
        steps: list[tuple[str, tuple[int, ...], str]], chain: tuple[int, ...],
        engine: str) -> None:
    holdings = ApproxHoldings(64)
    run(holdings, steps)
    before = holdings.held_tokens(key(chain), ENGINES)
    holdings.confirm(key(chain), engine)
    assert holdings.held_tokens(key(chain), ENGINES) == before
    settled = holdings.settled_tokens(key(chain), ENGINES)
    assert settled.get(engine, 0.0) <= before.get(engine, 0.0)


def test_a_holding_settles_when_confirmed_and_is_forgotten_with_its_engine() -> None:
    holdings = ApproxHoldings(64)
    k = key((1, 2, 3, 4))
    holdings.record(k, "e0")
    assert holdings.held_tokens(k, ENGINES) == {"e0": 256.0}
    assert holdings.settled_tokens(k, ENGINES) == {}  # sent, not yet computed
    holdings.confirm(k, "e0")
    assert holdings.settled_tokens(k, ENGINES) == {"e0": 256.0}
    # A longer prompt recorded after it: its tail is provisional, its settled part stays.
    longer = key((1, 2, 3, 4, 5, 6))
    holdings.record(longer, "e0")
    assert holdings.settled_tokens(longer, ENGINES) == {"e0": 256.0}
    holdings.forget("e0")
    assert holdings.settled_tokens(k, ENGINES) == {}
    assert holdings.settled.size("e0") == 0
    assert holdings.settled_tokens(RouteKey(()), ENGINES) == {}


def test_a_first_byte_settles_the_prompt_where_it_was_answered() -> None:
    policy = ExpectedTTFT(RoutingConfig(charge_abandoned=True))
    k = key((1, 2, 3))
    policy.dispatched(7, k, "e0")
    policy.first_byte(8, "e0")  # another request's token: nothing to settle
    assert policy.top_settled(k, ENGINES) == 0.0
    policy.first_byte(7, "e0")
    assert policy.top_settled(k, ENGINES) == 192.0
    policy.first_byte(7, "e0")  # twice is harmless


def test_requests_awaiting_their_first_byte_are_bounded() -> None:
    policy = ExpectedTTFT(RoutingConfig(charge_abandoned=True))
    for token in range(MAX_UNCONFIRMED + 10):
        policy.dispatched(token, key((1,)), "e1")
    assert len(policy._unconfirmed) == MAX_UNCONFIRMED
    policy.first_byte(0, "e0")  # the oldest were dropped: nothing settles
    assert policy.top_settled(key((1,)), ENGINES) == 0.0
    off = ExpectedTTFT(RoutingConfig(charge_abandoned=False))
    off.dispatched(1, key((1,)), "e0")
    off.first_byte(1, "e0")
    assert off.top_settled(key((1,)), ENGINES) == 0.0  # nothing settles when nothing reads it
    assert not off._unconfirmed


def test_exact_holdings_settle_only_what_the_engines_events_reported() -> None:
    ids = list(range(100, 140))
    keys = chain_keys(ids, 8)
    index = ExactIndex(capacity=100, provisional_s=5.0)
    index.apply(Batch(0.0, (Stored(tuple(keys[:2]), 8),), 0))
    index.provisional(keys, now=0.0)  # the rest just sent there
    found = PreciseHoldings(ids, PLAIN_ROOT, 64)
    found.add("e0", index, 8, now=1.0)
    assert found.known(["e0"]) == {"e0": 40.0}
    assert found.known_settled(["e0", "e1"]) == {"e0": 16.0}
    index.apply(Batch(2.0, (Stored(tuple(keys[2:]), 8),), 0))  # the engine reports them
    found.add("e0", index, 8, now=2.0)
    assert found.known_settled(["e0"]) == {"e0": 40.0}


def test_a_refused_request_takes_back_only_the_blocks_its_record_added() -> None:
    policy = ExpectedTTFT(RoutingConfig())
    shared, longer = key((1, 2)), key((1, 2, 3, 4))
    policy.dispatched("first", shared, "e0")
    policy.first_byte("first", "e0")
    policy.dispatched("refused", longer, "e0")
    assert policy.holdings.held_tokens(longer, ENGINES) == {"e0": 256.0}
    policy.refused("refused", "e0")
    # The shared prefix that an answered request recorded stays, settled; the rest goes.
    assert policy.holdings.held_tokens(longer, ENGINES) == {"e0": 128.0}
    assert policy.top_settled(longer, ENGINES) == 128.0
    policy.first_byte("refused", "e0")  # ended once: a late first byte finds nothing
    assert policy.holdings.held_tokens(longer, ENGINES) == {"e0": 128.0}
    # Refused by a retry's engine: the record on the engine it was sent to is not that one's.
    policy.dispatched("retried", longer, "e0")
    policy.refused("retried", "e1")
    assert policy.holdings.held_tokens(longer, ENGINES) == {"e0": 256.0}


def test_only_answered_prompts_count_in_the_pools_mean_prompt() -> None:
    policy = ExpectedTTFT(RoutingConfig())
    policy.dispatched(1, RouteKey((1,), prompt_tokens=100_000.0), "e0")
    policy.refused(1, "e0")
    assert policy.mean_prompt == 0.0
    policy.dispatched(2, RouteKey((2,), prompt_tokens=500.0), "e0")
    policy.first_byte(2, "e0")
    assert policy.mean_prompt == 500.0
