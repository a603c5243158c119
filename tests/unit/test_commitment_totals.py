"""Commitments' running total of what unanswered flights owe: exact after any sequence of
dispatches, first bytes and settlements (pure: no sockets, no clock)."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.commitment import Commitments, Flight, exact, owed
from proxy.core.config import AdmissionConfig, PressureConfig
from proxy.core.pressure import PressureTracker

TOKENS = st.floats(min_value=0.0, max_value=1e9, allow_nan=False) | st.sampled_from(
    [0.1, 1e-300, 5e-324, 1e9 + 0.5, 3.0]
)
OPS = st.lists(
    st.tuples(st.sampled_from(["dispatch", "first_byte", "settle"]), st.integers(0, 7),
              TOKENS, TOKENS),
    max_size=60,
)


def fresh(book: Commitments, flights: dict[int, Flight]) -> int:
    """The unanswered flights' owed tokens re-summed from scratch, exactly."""
    return sum(exact(f.prompt_tokens) + exact(max(0.0, f.output_tokens))
               for f in flights.values() if not f.answered)


def apply(book: Commitments, flights: dict[int, Flight], op: str, ticket: int, prompt: float,
          output: float) -> None:
    """One operation on the book and on the model of it; a settle hands back the flight booked."""
    if op == "dispatch":
        flights[ticket] = book.dispatch(ticket, Flight(prompt, output))
    elif op == "first_byte":
        book.first_byte(ticket)
    else:
        assert book.settle(ticket) is flights.pop(ticket, None)


@given(OPS)
def test_the_running_total_equals_a_fresh_exact_sum_after_any_operations(
    ops: list[tuple[str, int, float, float]],
) -> None:
    book, flights = Commitments(), {}
    for op, ticket, prompt, output in ops:
        apply(book, flights, op, ticket, prompt, output)
        assert book.waiting_owed == fresh(book, flights)
        assert len(book) == len(flights)
        unanswered = [f for f in flights.values() if not f.answered]
        terms = [t for f in unanswered for t in (f.prompt_tokens, f.output_tokens)]
        if len(unanswered) == len(flights):  # all in the total: one correct rounding, as fsum
            assert book.owed_blocks(16, 10.0) == math.fsum(terms) / 16


@given(OPS, st.sampled_from([None, 4.0, 37.5]), st.integers(0, 5000))
def test_owed_blocks_is_the_sum_of_every_flights_owed_blocks(
    ops: list[tuple[str, int, float, float]], bytes_per_token: float | None, relayed: int,
) -> None:
    book, flights = Commitments(), {}
    for op, ticket, prompt, output in ops:
        apply(book, flights, op, ticket, prompt, output)
        if op == "first_byte" and ticket in flights:
            flights[ticket].relayed = relayed
    want = math.fsum(owed(f, 16, bytes_per_token) for f in flights.values())
    assert math.isclose(book.owed_blocks(16, bytes_per_token), want, rel_tol=1e-12,
                        abs_tol=1e-300)


def test_a_large_flight_settled_leaves_exactly_what_the_small_one_owes() -> None:
    # A float running total would keep 0.0 here: 1e20 + 0.1 - 1e20 loses the 0.1.
    book = Commitments()
    book.dispatch(1, Flight(prompt_tokens=1e20, output_tokens=0.0))
    book.dispatch(2, Flight(prompt_tokens=0.1, output_tokens=0.0))
    book.settle(1)
    assert book.owed_blocks(1, None) == 0.1
    book.first_byte(2)  # answered: its prompt is in the engine, nothing more owed
    assert book.owed_blocks(1, None) == 0.0
    assert book.waiting_owed == 0


def test_a_ticket_booked_twice_counts_once_as_its_latest_flight() -> None:
    book = Commitments()
    book.dispatch(1, Flight(prompt_tokens=100, output_tokens=0))
    book.dispatch(1, Flight(prompt_tokens=32, output_tokens=0))
    assert len(book) == 1
    assert book.owed_blocks(16, None) == 2.0
    book.first_byte(1)
    book.dispatch(1, Flight(prompt_tokens=0, output_tokens=64, answered=True))
    assert len(book) == 1
    assert book.owed_blocks(16, None) == 4.0


def test_bytes_counted_before_the_first_byte_produce_nothing() -> None:
    book = Commitments()
    flight = book.dispatch(1, Flight(prompt_tokens=0, output_tokens=320))
    flight.relayed = 1600
    assert book.owed_blocks(16, 10.0) == 20.0  # the whole output: none produced before it
    book.first_byte(1)
    assert book.owed_blocks(16, 10.0) == 10.0  # 160 of 320 tokens produced


def test_the_guard_hands_back_the_same_pressure_until_something_changes() -> None:
    adm = AdmissionConfig()
    t = PressureTracker(PressureConfig(), sheddable=adm.sheddable, standard=adm.standard,
                        interval_s=0.2, stale_after_s=1.0)
    t.observe(0.0, 0.2, 0.0)
    t.commit(0.5, 16_000)
    first = t.pressure(0.1)
    assert t.pressure(0.15) is first
    t.commit(0.6, 16_000)
    second = t.pressure(0.15)
    assert second.committed_kv == 0.6 and first.committed_kv == 0.5
    t.observe(0.2, 0.3, 0.0)  # a new snapshot: a new judgement
    assert t.pressure(0.25).projected_kv != second.projected_kv


@given(st.lists(st.tuples(TOKENS, st.integers(0, 10**7)), max_size=20),
       st.sampled_from([None, 0.0, 1.0, 7.5, 4096.0]))
def test_answered_flights_sum_to_the_last_bit_as_the_per_flight_formula(
    answered: list[tuple[float, int]], bytes_per_token: float | None
) -> None:
    # Flights past their expected output (relayed beyond it) owe nothing, never less than that.
    book = Commitments()
    want = 0.0
    for ticket, (output, relayed) in enumerate(answered):
        book.dispatch(ticket, Flight(0.0, output, answered=True, relayed=relayed))
        produced = relayed / bytes_per_token if bytes_per_token else 0.0
        want += max(0.0, output - produced)
    assert book.owed_blocks(16, bytes_per_token) == want / 16


KEPT_OPS = st.lists(
    st.tuples(st.sampled_from(["dispatch", "first_byte", "settle", "relay", "ask"]),
              st.integers(0, 7), st.integers(1, 5000).map(float), st.integers(0, 4000),
              st.floats(0.0, 0.03)),
    max_size=80,
)


@settings(max_examples=300)
@given(KEPT_OPS, st.sampled_from([None, 4.0, 37.5]))
def test_the_kept_answered_sum_bounds_a_fresh_one_and_is_fresh_after_its_interval(
    ops: list[tuple[str, int, float, int, float]], bytes_per_token: float | None,
) -> None:
    # Asked with the time, the answered flights' part may be up to ``refresh_s`` old, but never
    # below a fresh sum at the figure it was taken with: a flight's bytes only grow, and one
    # answered or settled since is counted at once. Past the interval, it is the fresh sum.
    refresh = 0.05
    book, flights = Commitments(refresh_s=refresh), {}
    now = 0.0
    for op, ticket, output, more, step in ops:
        now += step
        if op == "relay":
            if ticket in flights:
                flights[ticket].relayed += more
        elif op == "ask":
            kept = book.owed_blocks(16, bytes_per_token, now)
            fresh_now = book.owed_blocks(16, bytes_per_token)
            assert kept >= fresh_now * (1 - 1e-9) - 1e-300
        else:
            apply(book, flights, op, ticket, output, output)
    later = book.owed_blocks(16, bytes_per_token, now + refresh)
    assert math.isclose(later, book.owed_blocks(16, bytes_per_token), rel_tol=1e-12,
                        abs_tol=1e-300)


def test_the_kept_sum_counts_an_answer_and_a_settlement_at_once_and_output_after_refresh(
) -> None:
    book = Commitments(refresh_s=0.05)
    first = book.dispatch(1, Flight(prompt_tokens=0, output_tokens=320))
    book.first_byte(1)
    assert book.owed_blocks(16, 10.0, now=1.0) == 20.0
    first.relayed = 1600  # 160 tokens produced: within the interval, still counted as owed
    assert book.owed_blocks(16, 10.0, now=1.01) == 20.0
    second = book.dispatch(2, Flight(prompt_tokens=0, output_tokens=160))
    book.first_byte(2)  # answered since the sum: added at once, at what it owes
    assert book.owed_blocks(16, 10.0, now=1.02) == 30.0
    second.relayed = 800
    book.settle(2)  # taken off at what it owes now (80 tokens), so the bound stays above
    assert book.owed_blocks(16, 10.0, now=1.03) == 25.0
    assert book.owed_blocks(16, 10.0, now=1.05) == 10.0  # re-summed: 160 of 320 produced
    assert book.owed_blocks(16, 10.0, now=0.5) == 10.0  # a clock gone back re-sums too
