"""Reading vLLM's exposition and rendering the sidecar's series."""

from engine_sidecar.vllm.metrics import (
    SidecarState,
    combine,
    implausible,
    in_flight,
    parse_samples,
    render_derived,
    spec_counters,
)
from engine_sidecar.vllm.spec import SpecCounters, derive_stats

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 36.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 11.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 11.0
vllm:cache_config_info{block_size="32",note="a \\"quoted\\" value"} 1.0
not a sample line
vllm:bad_value{engine="0"} abc
"""


def test_in_flight_sums_ranks_and_queue():
    samples = list(parse_samples(VLLM_TEXT))
    assert in_flight(samples) == 7.0
    assert in_flight([]) is None


def test_labels_with_escaped_quotes_parse():
    info = next(s for s in parse_samples(VLLM_TEXT) if s.name == "vllm:cache_config_info")
    assert info.labels["block_size"] == "32"


def test_spec_counters_order_positions():
    c = spec_counters(list(parse_samples(VLLM_TEXT)))
    assert c == SpecCounters(12.0, 36.0, 30.0, (11.0, 11.0, 8.0))
    assert spec_counters(list(parse_samples("vllm:num_requests_running 1\n"))) is None


def test_derived_series_without_spec():
    text = render_derived(SidecarState(True, False, True, 2, 0), None)
    assert "kvproxy_sidecar_ready 1\n" in text
    assert "kvproxy_sidecar_draining 0\n" in text
    assert "kvproxy_sidecar_engine_restarts_total 2\n" in text
    assert "spec" not in text


def test_derived_series_with_spec():
    stats = derive_stats(SpecCounters(10, 30, 18, (8, 6, 4)), 60.0, num_speculative_tokens=3,
                         token_cost=0.1)
    text = render_derived(SidecarState(False, True, True, 0, 3), stats)
    samples = {(s.name, s.labels.get("position")): s.value for s in parse_samples(text)}
    assert samples[("kvproxy_sidecar_ready", None)] == 0
    assert samples[("kvproxy_sidecar_draining", None)] == 1
    assert samples[("kvproxy_sidecar_spec_acceptance_rate", None)] == 0.6
    assert samples[("kvproxy_sidecar_spec_mean_acceptance_length", None)] == 2.8
    assert samples[("kvproxy_sidecar_spec_acceptance_per_position", "2")] == 0.4
    assert samples[("kvproxy_sidecar_spec_best_num_speculative_tokens", None)] == 3
    assert samples[("kvproxy_sidecar_spec_num_speculative_tokens", None)] == 3


def test_combine_keeps_engine_text_first():
    assert combine(None, "ours\n") == "ours\n"
    assert combine("theirs\n\n", "ours\n") == "theirs\nours\n"


def test_values_no_engine_reports_are_no_values():
    hostile = """\
vllm:num_requests_running{engine="0"} +Inf
vllm:num_requests_running{engine="1"} 3
vllm:num_requests_waiting{engine="0"} -2
vllm:spec_decode_num_drafts_total{engine="0"} 1e308
vllm:spec_decode_num_drafts_total{engine="1"} 10
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} NaN
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="999999999"} 1
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="64"} 1
"""
    samples = list(parse_samples(hostile))
    assert in_flight(samples) == 3.0  # the infinite rank and the negative queue are not counted
    c = spec_counters(samples)
    assert c is not None and c.drafts == 10.0
    assert c.accepted_per_pos == (0.0, 4.0)  # NaN dropped, no 10**9-long tuple
    assert implausible(samples, {"vllm:num_requests_waiting"}) == "vllm:num_requests_waiting"
    assert implausible(list(parse_samples(VLLM_TEXT)), {"vllm:num_requests_running"}) is None
