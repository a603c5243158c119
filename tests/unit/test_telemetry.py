
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from proxy.core.config import TelemetryConfig
from proxy.core.engine_state import (
    TRANSITIONS,
    EngineState,
    Health,
    HealthEvent,
    IllegalTransition,
)
from proxy.core.errors import ConfigError
from proxy.core.telemetry import (
    EngineSnapshot,
    ImplausibleMetrics,
    MetricsError,
    parse_labels,
    parse_metrics,
)

VLLM_TEXT = r"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m \"quoted\" {x}"} 3.0
vllm:num_requests_running{engine="1",model_name="m \"quoted\" {x}"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.3
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} NaN
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0
kvproxy_sidecar_ready 1
kvproxy_sidecar_draining 0
"""


def test_parse_real_shape() -> None:
    snap = parse_metrics(VLLM_TEXT, taken_at=12.5)
    assert snap.taken_at == 12.5
    assert snap.running == 5.0  # summed over the engine label
    assert snap.waiting == 1.0
    assert snap.kv_usage == pytest.approx(0.4)  # a fraction: averaged over ranks
    assert snap.prefix_queries == 1500.0
    assert snap.prefix_hits == 250.0
    assert snap.preemptions == 7.0
    assert (snap.spec_drafts, snap.spec_draft_tokens, snap.spec_accepted) == (10.0, 30.0, 20.0)
    assert snap.block_size == 16
    assert snap.num_gpu_blocks == 2048
    assert snap.draining is False and snap.ready is True


def test_legacy_kv_name_and_preference() -> None:
    legacy = (
        "vllm:gpu_cache_usage_perc 0.7\nvllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    )
    assert parse_metrics(legacy, taken_at=0).kv_usage == 0.7
    both = legacy + "vllm:kv_cache_usage_perc 0.2\n"
    assert parse_metrics(both, taken_at=0).kv_usage == 0.2


def test_draining_and_not_ready() -> None:
    base = "vllm:kv_cache_usage_perc 0\nvllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    assert parse_metrics(base + "kvproxy_sidecar_draining 1\n", taken_at=0).draining
    assert not parse_metrics(base + "kvproxy_sidecar_ready 0\n", taken_at=0).ready


@pytest.mark.parametrize(
    "missing", ["kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"]
)
def test_missing_required_series(missing: str) -> None:
    lines = [ln for ln in VLLM_TEXT.splitlines() if missing not in ln]
    with pytest.raises(MetricsError):
        parse_metrics("\n".join(lines), taken_at=0)


@pytest.mark.parametrize(
    "text", ["", "<html>502 Bad Gateway</html>", "vllm:kv_cache_usage_perc NaN\n"]
)
def test_unusable_text(text: str) -> None:
    with pytest.raises(MetricsError):
        parse_metrics(text, taken_at=0)


def test_special_values_and_timestamps() -> None:
    text = (
        'vllm:kv_cache_usage_perc{engine="0"} 0.25 1700000000000\n'
        "vllm:num_requests_running 1\n"
        'vllm:num_requests_waiting{a="}"} 2\n'
        "vllm:num_preemptions_total garbage\n"
        "vllm:num_preemptions_total NaN\n"
    )
    snap = parse_metrics(text, taken_at=0)
    assert snap.kv_usage == 0.25
    assert snap.running == 1.0
    assert snap.waiting == 2.0
    assert snap.preemptions == 0.0


BASE = "vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"


@pytest.mark.parametrize(
    "line",
    [
        "vllm:kv_cache_usage_perc -5",  # would attract every request
        'vllm:kv_cache_usage_perc{engine="1"} 7',
        "vllm:gpu_cache_usage_perc 1.5",
        "vllm:kv_cache_usage_perc +Inf",
        "vllm:num_requests_running -1e6",  # would disable shedding
        'vllm:num_requests_running{engine="1"} -1',  # hidden in a sum over ranks
        "vllm:num_requests_waiting 1e12",
        "vllm:num_requests_waiting +Inf",
        "vllm:num_requests_running -Inf",
        "vllm:prefix_cache_hits_total -3",
        "vllm:num_preemptions_total +Inf",
        "kvproxy_sidecar_ready -1",
    ],
)
def test_implausible_figures_make_the_snapshot_unusable(line: str) -> None:
    with pytest.raises(ImplausibleMetrics) as err:
        parse_metrics(BASE + line + "\n", taken_at=0)
    assert err.value.reason == "out_of_range"
    assert isinstance(err.value, MetricsError)


def test_plausible_edges_are_believed() -> None:
    text = (
        "vllm:kv_cache_usage_perc 1.005\nvllm:num_requests_running 0\n"
        "vllm:num_requests_waiting 1000000\nvllm:prefix_cache_queries_total 1e15\n"
    )
    snap = parse_metrics(text, taken_at=0)
    assert (snap.kv_usage, snap.waiting, snap.prefix_queries) == (1.005, 1e6, 1e15)
    assert MetricsError("x").reason == "unparsable"


@pytest.mark.parametrize("size", ["0", "-16", "1e300", "nan", "x"])
def test_absurd_cache_config_is_ignored(size: str) -> None:
    text = BASE + f'vllm:cache_config_info{{block_size="{size}",num_gpu_blocks="{size}"}} 1\n'
    snap = parse_metrics(text, taken_at=0)
    assert snap.block_size is None and snap.num_gpu_blocks is None


def test_parse_labels_escapes() -> None:
    labels = parse_labels(r'a="x\"y",b="back\\slash",c="new\nline",d="}"')
    assert labels == {"a": 'x"y', "b": "back\\slash", "c": "new\nline", "d": "}"}


def test_agrees_with_prometheus_client() -> None:
    running = 0.0
    for family in text_string_to_metric_families(VLLM_TEXT):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                running += sample.value
    assert parse_metrics(VLLM_TEXT, taken_at=0).running == running


# --- health state machine ------------------------------------------------------------------------


def snap(at: float, **kw: object) -> EngineSnapshot:
    values: dict[str, object] = {"taken_at": at, "kv_usage": 0.1, "running": 1.0, "waiting": 0.0}
    values.update(kw)
    return EngineSnapshot(**values)  # type: ignore[arg-type]


def health(s: EngineState) -> Health:
    return s.health  # read through a call, so the type checker does not narrow across moves


def state(**kw: float) -> EngineState:
    return EngineState("e0", "target", "http://e0", stale_after_s=1.0, **kw)  # type: ignore[arg-type]


def test_lifecycle() -> None:
    s = state()
    assert health(s) is Health.UNKNOWN
    assert not s.view(0.0, True).routable
    s.on_scrape_ok(snap(0.0), 0.0)
    assert health(s) is Health.HEALTHY
    view = s.view(0.5, True)
    assert view.routable and view.fresh and view.load == 1.0 and view.kv_usage == 0.1
    assert not s.view(0.5, False).routable  # breaker says no
    # Older than stale_after_s without a failed scrape (the proxy was too busy to scrape): the
    # engine is not held to blame and stays fresh.
    assert s.view(1.6, True).fresh and health(s) is Health.HEALTHY
    # Older than stale_after_s with a failed scrape since: STALE, still routable (as a last
    # resort), but not fresh.
    s.on_scrape_failed(1.6, "timeout")
    view = s.view(1.6, True)
    assert health(s) is Health.STALE and view.routable and not view.fresh
    s.on_scrape_ok(snap(2.0), 2.0)
    assert health(s) is Health.HEALTHY


def test_failures_make_unhealthy_then_recover() -> None:
    s = state(unhealthy_after_failures=3)
    s.on_scrape_ok(snap(0.0), 0.0)
    s.on_scrape_failed(0.2, "timeout")
    s.on_scrape_failed(0.4, "timeout")
    assert health(s) is Health.HEALTHY
    s.on_scrape_failed(0.6, "timeout")
    assert health(s) is Health.UNHEALTHY and s.last_error == "timeout"
    assert not s.view(0.6, True).routable
    s.on_scrape_ok(snap(0.8), 0.8)
    assert health(s) is Health.HEALTHY and s.consecutive_failures == 0


def test_draining_is_unroutable() -> None:
    s = state()
    s.on_scrape_ok(snap(0.0, draining=True), 0.0)
    assert health(s) is Health.DRAINING
    assert not s.view(0.1, True).routable
    s.on_scrape_ok(snap(0.2, ready=False), 0.2)
    assert health(s) is Health.DRAINING
    s.on_scrape_ok(snap(0.4), 0.4)
    assert health(s) is Health.HEALTHY


def test_illegal_transition_raises() -> None:
    s = state()
    with pytest.raises(IllegalTransition):
        s._move(HealthEvent.AGED)  # UNKNOWN cannot age
    assert (Health.UNHEALTHY, HealthEvent.AGED) not in TRANSITIONS


def test_inflight_accounting() -> None:
    s = state()
    s.on_scrape_ok(snap(0.0, running=2.0, waiting=1.0), 0.0)
    tickets = [s.on_dispatch(0.05 + i * 0.01) for i in range(4)]
    assert s.view(0.1, True).load == 3.0 + 4
    assert s.open_requests == s.inflight == 4
    s.on_settle(tickets[0])  # finished before any scrape saw it
    assert s.view(0.1, True).load == 3.0 + 3
    # A scrape started at 0.065 already counts the dispatches before it.
    s.on_scrape_ok(snap(0.065, running=5.0, waiting=0.0), 0.2)
    assert s.dispatched_since_snapshot == 2
    assert s.view(0.2, True).load == 5.0 + 2
    for t in tickets[1:]:
        s.on_settle(t)
    assert s.open_requests == 0
    s.on_settle()  # never below zero
    assert s.open_requests == 0


def test_prefill_backlog_counts_until_the_first_byte() -> None:
    s = state()
    s.on_scrape_ok(snap(0.0), 0.0)
    a = s.on_dispatch(0.05, prefill=30.0)
    b = s.on_dispatch(0.06, prefill=12.0)
    s.on_dispatch(0.07)  # nothing to prefill (all cached, or unknown)
    assert s.view(0.1, True).prefill == 42.0
    s.on_first_byte(a)
    assert s.view(0.1, True).prefill == 12.0
    s.on_scrape_ok(snap(0.2), 0.2)  # a snapshot does not clear it: only the answer does
    assert s.view(0.2, True).prefill == 12.0
    s.on_settle(b)  # failed or cancelled before its first byte
    s.on_first_byte(a)  # twice is harmless
    assert s.view(0.2, True).prefill == 0.0


def test_dispatch_without_time_resets_on_next_snapshot() -> None:
    s = state()
    s.on_scrape_ok(snap(0.0), 0.0)
    s.on_dispatch()
    s.on_dispatch()
    assert s.dispatched_since_snapshot == 2
    s.on_scrape_ok(snap(0.2), 0.2)
    assert s.dispatched_since_snapshot == 0


events = st.lists(
    st.one_of(
        st.tuples(st.just("ok"), st.booleans()),
        st.tuples(st.just("fail"), st.just(False)),
        st.tuples(st.just("tick"), st.just(False)),
    ),
    max_size=40,
)


@given(events)
def test_any_event_sequence_stays_in_the_table(seq: list[tuple[str, bool]]) -> None:
    s = state()
    now = 0.0
    for kind, draining in seq:
        now += 0.3
        if kind == "ok":
            s.on_scrape_ok(snap(now, draining=draining), now)
            assert health(s) is (Health.DRAINING if draining else Health.HEALTHY)
        elif kind == "fail":
            s.on_scrape_failed(now)
        else:
            s.tick(now, 1.0)
        view = s.view(now, True)
        assert view.routable == (s.health in (Health.HEALTHY, Health.STALE))
        assert view.fresh == (health(s) is Health.HEALTHY)
        if view.fresh and s.consecutive_failures:  # age alone (no failed scrape) is no fault
            assert s.snapshot is not None and now - s.snapshot.taken_at <= 1.0


def test_reads_the_simulator_exposition() -> None:
    sim = pytest.importorskip("engine_sidecar.sim.metrics")
    reading = sim.EngineReading(
        model='m "q"',
        running=4,
        waiting=2,
        kv_usage=0.6,
        legacy_kv_metric=True,
        block_size=16,
        num_gpu_blocks=1000,
        prefix_caching=True,
        counters={"vllm:prefix_cache_queries_total": 10.0, "vllm:prefix_cache_hits_total": 4.0},
        spec_per_pos=None,
        draining=True,
    )
    got = parse_metrics(sim.render(reading, sim.LatencyMetrics()), taken_at=1.0)
    assert (got.running, got.waiting, got.kv_usage) == (4.0, 2.0, 0.6)
    assert (got.prefix_queries, got.prefix_hits) == (10.0, 4.0)
    assert (got.block_size, got.num_gpu_blocks) == (16, 1000)
    assert got.draining and not got.ready


def test_late_snapshot_does_not_replace_newer() -> None:
    s = state()
    s.on_scrape_ok(snap(1.0, running=7.0), 1.0)
    s.on_scrape_ok(snap(0.5, running=1.0), 1.1)
    assert s.snapshot is not None and s.snapshot.running == 7.0


# --- frozen metrics ------------------------------------------------------------------------------


def test_idle_repeats_are_news() -> None:
    s = state()
    assert s.body_is_news(1, started=0.0, fetched_at=0.01)
    for i in range(1, 50):
        assert s.body_is_news(1, started=i * 0.2, fetched_at=i * 0.2 + 0.01)


def test_a_request_finishing_across_a_scrape_proves_nothing() -> None:
    """The race that used to latch an engine STALE: the engine finished a request, a scrape saw
    the new text before the proxy read the answer, and every later idle text repeats it."""
    s = state()
    assert s.body_is_news(1, started=0.0, fetched_at=0.01)
    t = s.on_dispatch(0.1)
    assert s.body_is_news(2, started=0.2, fetched_at=0.21)  # the engine already counted it
    s.on_complete(t, 0.25)  # the proxy reads the answer only now
    s.on_settle(t)
    for i in range(2, 20):
        assert s.body_is_news(2, started=i * 0.2, fetched_at=i * 0.2 + 0.01)
    assert s.completed == 1


def test_a_request_served_between_two_scrapes_proves_a_repeat_frozen() -> None:
    s = state()
    s.body_is_news(1, started=0.0, fetched_at=0.01)
    t = s.on_dispatch(0.05)
    s.on_complete(t, 0.1)
    s.on_settle(t)
    assert not s.body_is_news(1, started=0.2, fetched_at=0.21)
    # Probed again next round: no request in between, so the repeat is believed.
    assert s.body_is_news(1, started=0.4, fetched_at=0.41)


@pytest.mark.parametrize(
    ("dispatched", "completed", "frozen"),
    [
        (0.01, 0.1, False),  # dispatched exactly when the text arrived: maybe counted in it
        (0.005, 0.1, False),  # dispatched before the text arrived
        (0.05, 0.2, False),  # completed as the next scrape began
        (0.05, 0.3, False),  # completed after the next scrape began
        (0.05, 0.19, True),
    ],
)
def test_frozen_only_with_proof(dispatched: float, completed: float, frozen: bool) -> None:
    s = state()
    s.body_is_news(1, started=0.0, fetched_at=0.01)
    t = s.on_dispatch(dispatched)
    s.on_complete(t, completed)
    assert s.body_is_news(1, started=0.2, fetched_at=0.21) is not frozen


def test_failed_or_untimed_requests_prove_nothing() -> None:
    s = state()
    s.body_is_news(1, started=0.0, fetched_at=0.01)
    s.on_settle(s.on_dispatch(0.05))  # failed: never completed
    untimed = s.on_dispatch()  # dispatch time unknown
    s.on_complete(untimed, 0.1)
    assert s.body_is_news(1, started=0.2, fetched_at=0.21)
    assert s.completed == 1


def test_a_changed_text_is_news_and_resets_the_proof() -> None:
    s = state()
    s.body_is_news(1, started=0.0, fetched_at=0.01)
    t = s.on_dispatch(0.05)
    s.on_complete(t, 0.1)
    assert s.body_is_news(2, started=0.2, fetched_at=0.21)
    assert s.body_is_news(2, started=0.4, fetched_at=0.41)


# --- health reasons ------------------------------------------------------------------------------


def test_health_reason_names_the_cause() -> None:
    s = state(unhealthy_after_failures=2)
    assert s.health_reason == "not scraped yet"
    s.on_scrape_ok(snap(0.0), 0.0)
    assert s.health_reason is None
    s.on_scrape_failed(0.2, "frozen metrics")
    assert health(s) is Health.HEALTHY and s.health_reason is None
    s.tick(1.5, 1.0)
    assert health(s) is Health.STALE
    assert s.health_reason == "no successful scrape recently: frozen metrics"
    s.on_scrape_failed(1.6, "scrape timed out")
    assert health(s) is Health.UNHEALTHY and s.health_reason == "scrape timed out"
    s.on_scrape_ok(snap(1.8, draining=True), 1.8)
    assert s.health_reason == "draining"
    s.on_scrape_ok(snap(2.0, ready=False), 2.0)
    assert s.health_reason == "not ready"
    s.on_scrape_ok(snap(2.2), 2.2)
    assert s.health_reason is None and s.last_error is None


def test_max_metrics_bytes_is_validated() -> None:
    assert TelemetryConfig().max_metrics_bytes == 4 * 1024 * 1024
    with pytest.raises(ConfigError) as err:
        TelemetryConfig(max_metrics_bytes=100)
    assert "max_metrics_bytes" in str(err.value)
