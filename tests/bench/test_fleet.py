"""Counter parsing and run deltas from engines' /metrics."""

import pytest

from bench.fleet import (
    FleetSpec,
    cache_config,
    deltas,
    fleet_hit_rate,
    parse_counters,
    requests_per_engine,
)

TEXT = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="m",engine="0"} 100.0
vllm:prefix_cache_hits_total{model_name="m",engine="1"} 50.0
vllm:prefix_cache_queries_total{model_name="m",engine="0"} 400.0
vllm:request_success_total{finished_reason="length",model_name="m",engine="0"} 3.0
vllm:request_success_total{finished_reason="stop",model_name="m",engine="0"} 1.0
vllm:num_requests_running{model_name="m",engine="0"} 7.0
"""


def test_counters_sum_over_label_sets_and_default_to_zero():
    c = parse_counters(TEXT)
    assert c["vllm:prefix_cache_hits_total"] == 150.0
    assert c["vllm:request_success_total"] == 4.0
    assert c["vllm:num_preemptions_total"] == 0.0
    assert "vllm:num_requests_running" not in c


def test_deltas_give_the_run_only():
    before = {"u": parse_counters(TEXT)}
    after_text = TEXT.replace("100.0", "400.0")
    after_text = after_text.replace("400.0\nvllm:request", "1000.0\nvllm:request")
    after = {"u": parse_counters(after_text)}
    d = deltas(before, after)
    assert d["u"]["vllm:prefix_cache_hits_total"] == 300.0
    assert fleet_hit_rate(d) == pytest.approx(300.0 / 600.0)
    assert requests_per_engine(d) == {"u": 0.0}


def test_fleet_command_line_carries_the_settings():
    argv = FleetSpec(engines=3, time_scale=10.0, num_gpu_blocks=500).argv(9000)
    assert argv[1:4] == ["-m", "engine_sidecar", "sim"]
    assert argv[argv.index("--engines") + 1] == "3"
    assert argv[argv.index("--num-gpu-blocks") + 1] == "500"
    assert argv[argv.index("--time-scale") + 1] == "10.0"
    assert "--max-model-len" not in argv


def test_cache_config_labels_are_read():
    text = ('vllm:cache_config_info{block_size="16",cache_dtype="auto",'
            'enable_prefix_caching="True",num_gpu_blocks="27618"} 1.0\n')
    assert cache_config(text)["num_gpu_blocks"] == "27618"
    assert cache_config("") == {}
