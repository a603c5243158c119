"""The cap on client connections: as configured, else half of the open-files limit left after
the reserve for the proxy's own descriptors and the grace past the cap, never below a floor, none
without a limit."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.conncap import FLOOR, GRACE_MAX, GRACE_MIN, PER_ENGINE, RESERVE, client_cap, grace


def test_a_configured_cap_is_kept_whatever_the_limit() -> None:
    assert client_cap(5, 1024, 8) == 5
    assert client_cap(50_000, 1024, 8) == 50_000
    assert client_cap(7, None, 8) == 7


def test_no_limit_on_open_files_means_no_cap() -> None:
    assert client_cap(None, None, 8) is None


def test_a_shell_default_limit_leaves_room_for_an_engine_connection_per_client() -> None:
    spare = 1024 - RESERVE - PER_ENGINE * 8
    assert client_cap(None, 1024, 8) == (spare - spare // 16) // 2 == 439
    assert grace(439) == 27


def test_the_grace_is_a_share_of_the_cap_within_bounds() -> None:
    assert grace(3) == GRACE_MIN
    assert grace(1600) == 100
    assert grace(10**6) == GRACE_MAX


@given(st.integers(min_value=0, max_value=10**7), st.integers(min_value=0, max_value=4096))
def test_clients_their_engine_connections_and_the_grace_fit_the_limit(
    limit: int, engines: int
) -> None:
    cap = client_cap(None, limit, engines)
    assert cap is not None and cap >= FLOOR
    if cap > FLOOR:  # above the floor, every client with its engine connection fits
        assert 2 * cap + grace(cap) + RESERVE + PER_ENGINE * engines <= limit
