"""An engine's prefill backlog, kept between admissions, follows every ticket and snapshot
change (pure: no sockets, no clock)."""

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.engine_state import EngineState
from proxy.core.sharing import Backlog
from proxy.core.telemetry import EngineSnapshot

OPS = st.lists(st.tuples(st.sampled_from(["dispatch", "first_byte", "settle", "scrape"]),
                         st.integers(1, 6), st.floats(0.0, 4096.0)), max_size=40)


def fresh(state: EngineState) -> Backlog:
    """The backlog computed from scratch, as before it was kept."""
    prefill, at, snap = state._prefill, state._dispatched_at, state.snapshot
    seen = 0 if snap is None else sum(1 for t in prefill if at.get(t, 1e300) <= snap.taken_at)
    return Backlog(sum(prefill.values()), float(len(prefill)), float(seen))


@given(OPS)
def test_the_kept_backlog_equals_a_fresh_one_after_any_operations(
    ops: list[tuple[str, int, float]],
) -> None:
    state, now = EngineState("e0", "p", "http://127.0.0.1:1"), 0.0
    for op, ticket, amount in ops:
        now += 0.05
        if op == "dispatch":
            state.on_dispatch(now, prefill=amount)
        elif op == "first_byte":
            state.on_first_byte(ticket)
        elif op == "settle":
            state.on_settle(ticket)
        else:
            snap = EngineSnapshot(taken_at=now - amount / 8192, kv_usage=0.1, running=1,
                                  waiting=0)
            state.on_scrape_ok(snap, now)
        assert state.backlog == fresh(state)
