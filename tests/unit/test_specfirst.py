"""The pure speculative-first decisions: verification, rounds, token roles, history, shapes."""

from __future__ import annotations

import random
from typing import Any

import pytest

from proxy.core.config import Config
from proxy.core.errors import ConfigError, UpstreamError
from proxy.core.fleet_config import AliasConfig, EngineConfig, PoolConfig
from proxy.core.specbatch import eta, hold
from proxy.core.specfirst import (
    AcceptanceHistory,
    HistoryConfig,
    Round,
    TokenFacts,
    Verdict,
    advance,
    cached_covers,
    eligibility,
    settle,
    top1,
    verify_greedy,
    verify_sampled,
)
from proxy.core.specshape import Detok, visible


def entry(top: int, actual: int | None = None, lp: float = -0.1) -> dict[str, Any]:
    out = {str(top): {"logprob": lp, "rank": 1, "decoded_token": "x"}}
    if actual is not None and actual != top:
        out[str(actual)] = {"logprob": lp - 3, "rank": 7, "decoded_token": "y"}
    return out


def test_the_draft_is_kept_up_to_the_first_disagreement() -> None:
    draft = (5, 6, 7, 8)
    assert verify_greedy(draft, [entry(5), entry(6), entry(9, 7), entry(8)]) == Verdict(2, 9)
    assert verify_greedy(draft, [entry(t) for t in draft]) == Verdict(4, None)
    assert verify_greedy(draft, [entry(1, 5), *[entry(t) for t in draft[1:]]]) == Verdict(0, 1)


@pytest.mark.parametrize("bad", [None, {}, {"3": {"rank": 2}}, {"x": {"rank": 1}}])
def test_a_malformed_logprob_entry_is_the_engines_fault(bad: Any) -> None:
    with pytest.raises(UpstreamError):
        top1(bad)


def test_entries_must_cover_the_draft() -> None:
    with pytest.raises(UpstreamError):
        verify_greedy((1, 2), [entry(1)])


def known(stops: set[int] = frozenset({0}), goes_on: set[int] = frozenset()) -> TokenFacts:
    return TokenFacts(stops=set(stops), goes_on=set(goes_on) | set(range(1, 100)))


def test_a_correction_closes_the_round() -> None:
    step = advance(Round((5, 6, 7), "length", Verdict(1, 9)), known(), remaining=50)
    assert (step.tokens, step.from_draft, step.finish) == ((5, 9), 1, None)


def test_a_fully_kept_chunk_gains_the_targets_next_token() -> None:
    step = advance(Round((5, 6), "length", Verdict(2, None), bonus=7, bonus_finish="length"),
                   known(), remaining=50)
    assert (step.tokens, step.from_draft, step.finish) == ((5, 6, 7), 2, None)


def test_the_target_stopping_ends_the_answer() -> None:
    facts = known(stops=set())
    step = advance(Round((5, 6), "length", Verdict(2, None), bonus=200, bonus_finish="stop"),
                   facts, remaining=50)
    assert (step.tokens, step.finish) == ((5, 6, 200), "stop")
    assert facts.stop(200) is True


def test_a_draft_stopping_is_checked_against_the_target() -> None:
    facts = known(stops=set())
    step = advance(Round((5, 300), "stop", Verdict(2, None)), facts, remaining=50)
    assert (step.tokens, step.ask, step.ask_drafted) == ((5,), 300, True)
    done = settle(step, stopped=True, remaining=50)
    assert (done.tokens, done.from_draft, done.finish) == ((5, 300), 2, "stop")


def test_an_unknown_correction_token_is_asked_about() -> None:
    step = advance(Round((5, 6), "length", Verdict(0, 500)), known(), remaining=50)
    assert (step.tokens, step.ask) == ((), 500)
    assert settle(step, stopped=False, remaining=50).tokens == (500,)


def test_a_known_stop_inside_the_chunk_ends_the_answer_there() -> None:
    step = advance(Round((5, 0, 6), "length", Verdict(3, None), bonus=7), known(), remaining=9)
    assert (step.tokens, step.finish) == ((5, 0), "stop")


def test_max_tokens_ends_the_answer() -> None:
    step = advance(Round((5, 6), "length", Verdict(2, None), bonus=7, bonus_finish="length"),
                   known(), remaining=2)
    assert (step.tokens, step.finish) == ((5, 6), "length")
    step = advance(Round((5, 6), "length", Verdict(1, 8)), known(), remaining=2)
    assert (step.tokens, step.finish) == ((5, 8), "length")


def test_history_falls_back_and_retries() -> None:
    history = AcceptanceHistory(HistoryConfig(min_tokens=8, max_rejection=0.5, retry_s=10.0))
    key = ("acme", "alias")
    assert history.drafting(key, 0.0)
    fell = [history.record(key, 0, True, 1.0) for _ in range(8)]
    assert fell[-1] and not any(fell[:-1])
    assert not history.drafting(key, 5.0)
    assert not history.record(key, 0, True, 6.0)  # in-flight answers do not count twice
    assert history.drafting(key, 11.0)  # retried, judged afresh
    assert history.agreement(key) is None
    assert history.drafting(("other", "alias"), 5.0)  # per tenant


def test_the_chunk_follows_agreement() -> None:
    history = AcceptanceHistory(HistoryConfig(min_chunk=2, max_chunk=16, max_rejection=1.0))
    key = ("t", "a")
    assert history.chunk(key) == 16
    for _ in range(20):
        history.record(key, 1, True, 0.0)  # agreement 0.5: runs of ~1
    assert history.chunk(key) == 2
    for _ in range(64):
        history.record(key, 9, True, 0.0)  # agreement 0.9: runs of ~9
    assert history.chunk(key) == 16


@pytest.mark.parametrize(("body", "draft"), [
    ({"model": "m", "messages": [], "temperature": 0, "max_tokens": 5, "stream": True}, True),
    ({"model": "m", "prompt": "x", "temperature": 0, "n": 1, "logprobs": None}, True),
    ({"model": "m", "prompt": "x", "temperature": 0, "n": 2}, False),
    ({"model": "m", "prompt": "x", "temperature": 0, "logprobs": 0}, False),
    ({"model": "m", "messages": [], "temperature": 0, "logprobs": True}, False),
    ({"model": "m", "messages": [], "temperature": 0, "tools": []}, False),
    ({"model": "m", "messages": [], "temperature": 0, "stop": ["\n"]}, False),
    ({"model": "m", "messages": [], "temperature": 0.7}, False),
    ({"model": "m", "messages": []}, False),  # OpenAI's default temperature is 1
])
def test_only_what_verification_vouches_for_is_drafted(body: dict[str, Any],
                                                       draft: bool) -> None:
    assert eligibility(body, approximate=False).draft is draft


def test_sampled_requests_are_drafted_only_when_approximate() -> None:
    body = {"model": "m", "messages": [], "temperature": 0.7}
    verdict = eligibility(body, approximate=True)
    assert verdict.draft and verdict.sampled


def test_speculative_sampling_keeps_what_the_target_likes_as_much() -> None:
    same = [{"1": {"logprob": -0.1, "rank": 1}, "2": {"logprob": -2.4, "rank": 2}}] * 3
    assert verify_sampled((1, 1, 1), same, same, 1.0, random.Random(0)) == Verdict(3, None)
    target_hates = [{"2": {"logprob": -0.01, "rank": 1}}] * 3
    verdict = verify_sampled((1, 1, 1), same, target_hates, 1.0, random.Random(0))
    assert verdict == Verdict(0, 2)


def test_text_is_sent_once_and_never_a_cut_character() -> None:
    detok = Detok()
    assert detok.delta("héllo wo") == "héllo wo"
    assert detok.delta("héllo wor\ufffd") == "r"
    assert detok.delta("héllo world 🙂") == "ld 🙂"
    assert visible("end\ufffd") == "end"


def test_a_speculative_alias_names_both_pools() -> None:
    pools = (PoolConfig("small", "m-small", (EngineConfig("d", "http://d:1"),)),
             PoolConfig("big", "m-big", (EngineConfig("t", "http://t:1"),)))
    ok = AliasConfig("m", mode="speculative_first", draft="small", target="big")
    assert Config(pools=pools, aliases=(ok,)).aliases[0].chain(["small", "big"]) == ("big",)
    with pytest.raises(ConfigError, match="draft"):
        AliasConfig("m", mode="speculative_first", target="big")
    with pytest.raises(ConfigError, match="temperature_policy"):
        AliasConfig("m", mode="speculative_first", draft="small", target="big",
                    temperature_policy="exact")
    with pytest.raises(ConfigError, match=r"aliases\[0\]\.draft"):
        Config(pools=pools, aliases=(AliasConfig("m", mode="speculative_first", draft="tiny",
                                                 target="big"),))


def test_cached_verification_trusts_only_computed_positions() -> None:
    # 300 prompt tokens + 16 drafted: entry j needs position j - 1 computed, so the draft's
    # entries (300..315) are the target's only if at most 299 tokens came from the cache.
    assert cached_covers(316, 16, 288)
    assert cached_covers(316, 16, 0)
    assert cached_covers(316, 16, 299)
    assert not cached_covers(316, 16, 300)  # position 299 was cached: entry 300 is garbage
    assert not cached_covers(316, 16, 315)
    assert not cached_covers(316, 16, None)  # the engine did not say: trust nothing
    assert not cached_covers(316, 16, -1)


def test_a_ready_verification_is_held_only_while_others_can_join_it() -> None:
    # Opening a batch: only if another draft is expected back within the window.
    assert hold([0.01, 0.3], waited_s=0.0, window_s=0.05, opening=True)
    assert hold([-0.02], waited_s=0.0, window_s=0.05, opening=True)  # overdue: about to come
    assert not hold([0.2, 0.3], waited_s=0.0, window_s=0.05, opening=True)  # none in time
    assert not hold([], waited_s=0.0, window_s=0.05, opening=True)  # nobody drafting
    assert not hold([0.0], waited_s=0.0, window_s=0.0, opening=True)  # batching off
    # An open batch waits for every drafter until its window has passed.
    assert hold([0.2], waited_s=0.01, window_s=0.05, opening=False)
    assert not hold([0.0], waited_s=0.05, window_s=0.05, opening=False)
    assert not hold([], waited_s=0.01, window_s=0.05, opening=False)


def test_a_drafts_eta_comes_from_the_measured_seconds_per_token() -> None:
    assert eta(started=10.0, tokens=16, s_per_token=0.015, now=10.1) == pytest.approx(0.14)
    assert eta(started=10.0, tokens=16, s_per_token=None, now=10.1) == 0.0  # not learned yet


def test_verification_settings_are_checked() -> None:
    base = {"mode": "speculative_first", "draft": "d", "target": "t"}
    assert AliasConfig("a", **base).verify == "cached"
    with pytest.raises(ConfigError, match="verify_window_s"):
        AliasConfig("a", verify_window_s=2.0, **base)
    with pytest.raises(ConfigError, match="verify"):
        AliasConfig("a", verify="sometimes", **base)
