"""The report writer: tables, computed verdicts, failures named, docs page regenerated."""

import importlib.util
import math

from bench import report
from bench.machine import write_json
from bench.overhead import level_plan
from bench.targets import (
    best_peer_p90,
    high_concurrency_targets,
    overhead_targets,
    routing_targets,
)

MACHINE = {"nproc": 2, "cpu_model": "Test CPU", "kernel": "6", "python": "3.11",
           "memory_gib": 24.0, "load_avg_at_start": [0.5, 0.4, 0.3]}


def _summary(p90, **kw):
    s = {"requests": 100.0, "completed": 98.0, "shed": 1.0, "rate_limited": 0.0, "failed": 1.0,
         "ttft_p50": p90 / 2, "ttft_p90": p90, "ttft_p99": p90 * 2, "itl_p50": 0.02,
         "itl_p99": 0.1, "e2e_p50": 3.0, "e2e_p99": 9.0, "output_tokens": 5000.0,
         "throughput_tok_s": 321.5, "throughput_req_s": 1.2, "ttft_p90_ci": [p90 * 0.9, p90 * 1.1]}
    s.update(kw)
    return s


def _run(name, p90, hit, status="ok"):
    if status != "ok":
        return {"router": name, "status": status, "error": "boom: could not bind"}
    return {"router": name, "version": "1.0", "status": "ok", "summary": _summary(p90),
            "hit_rate": hit, "share_max_over_mean": 1.3, "preemptions": 4.0,
            "errors": ["1x 503: overloaded"], "router_cpu_s": 12.0, "duration_s": 60.0,
            "engine_requests": {"u0": 10.0, "u1": 12.0},
            "engine_load": {"queued_fraction": 0.25, "mean_waiting": 1.5, "mean_kv_usage": 0.5},
            "engine_kv_config": {"num_gpu_blocks": "100", "block_size": "16"}}


ROUTING = {
    "benchmark": "routing", "command": "python -m bench.routing --quick",
    "started_at": "2026-01-01 00:00:00 UTC", "finished_at": "2026-01-01 00:10:00 UTC",
    "machine": MACHINE, "versions": {"kvproxy": "0.1.0"},
    "settings": {"trace": "mooncake_conversation.jsonl", "slice_start_s": 0.0,
                 "slice_duration_s": 600.0, "rate_scale": 3.5, "time_scale": 3.0,
                 "compression": 10.5,
                 "caps": {"max_input_tokens": 16384, "max_output_tokens": 256,
                          "min_output_tokens": 1, "output_scale": 0.25},
                 "fleet": {"engines": 8, "profile": "llama70b-h100x4", "model": "m",
                           "time_scale": 10.0, "num_gpu_blocks": None, "max_model_len": 16704,
                           "max_num_seqs": None, "max_num_batched_tokens": None},
                 "engine_cores": "1", "router_cores": "0", "loadgen_cores": "unpinned",
                 "request_timeout_s": 180.0, "api": "chat", "quick": True},
    "trace": {"requests": 1750, "span_s": 599.0, "rate_per_s": 2.9, "mean_input_tokens": 10000.0,
              "max_input_tokens": 16384, "mean_output_tokens": 80.0, "max_output_tokens": 256,
              "ideal_hit_rate": 0.3, "round_robin_infinite_hit_rate": 0.09},
    "runs": [
        _run("kvproxy/round_robin", 4.0, 0.08),
        _run("kvproxy/prefix_affinity", 1.5, 0.28),
        _run("vllm-router/cache_aware", 2.0, 0.25),
        _run("vllm-router/round_robin", 4.5, 0.08),
        _run("litellm/least-busy", 0.0, 0.0, status="error"),
    ],
}

OVERHEAD = {
    "benchmark": "overhead", "command": "python -m bench.overhead --quick",
    "started_at": "2026-01-01 00:00:00 UTC", "machine": MACHINE, "versions": {"kvproxy": "0.1.0"},
    "settings": {"fleet": {"engines": 8, "profile": "p", "time_scale": 1.0},
                 "concurrency": [1, 64], "slice_s": 2.0, "rounds": 2, "prompt_tokens": 256,
                 "output_tokens": 64, "engine_cores": "1", "router_cores": "0",
                 "loadgen_cores": "unpinned"},
    "unavailable": {"sglang-router/round_robin": "not installed"},
    "levels": {
        str(c): {
            "direct": {"summary": _summary(0.02, ttft_p50=0.010), "cpu_ms_per_request": None,
                       "round_ttft_p50_ratios": None},
            "kvproxy/prefix_affinity": {"summary": _summary(0.02, ttft_p50=0.0104),
                                        "cpu_ms_per_request": 1.5,
                                        "round_ttft_p50_ratios": [1.02, 1.06]},
        }
        for c in (1, 64)
    },
    "relay": {"paced": {"events": 100000, "duration_s": 8.0, "events_per_s": 12500.0,
                        "proxy_cpu_s": 6.0, "proxy_cpu_util": 0.75, "events_per_cpu_s": 16666.7,
                        "streams": 64, "interval_ms": 1.0, "events_per_request": 2000},
              "burst": {"error": "firehose exited"}},
}


def test_targets_are_computed_from_the_runs():
    text = routing_targets(ROUTING["runs"], 0.3)
    assert "0.375" in text  # 1.5 / 4.0
    assert text.count("**met**") == 3  # p90 ratio, hit 0.28 >= 0.27, beats vllm-router's best
    assert best_peer_p90(ROUTING["runs"]) == {"vllm-router": ("vllm-router/cache_aware", 2.0)}


def test_missing_runs_are_not_measured_never_met():
    text = routing_targets([], float("nan"))
    assert "**met**" not in text and "not measured" in text


def test_report_writes_markdown_pngs_and_the_docs_page(tmp_path):
    results = tmp_path / "results"
    write_json(results / "routing.json", ROUTING)
    write_json(results / "overhead.json", OVERHEAD)
    docs = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(results), "--docs", str(docs)]) == 0
    routing = (results / "routing.md").read_text()
    assert "| kvproxy/prefix_affinity | 1.0 | 0.75 | 1.50 | 1.35-1.65 | 3.00 |" in routing
    assert "| 0.25 | 1.5 | 0.50 | 0.20 |" in routing
    assert "- kvproxy/prefix_affinity: 10 12" in routing
    assert "100 blocks x 16 tokens = 1600 tokens per engine" in routing
    assert "litellm/least-busy** (error): `boom: could not bind`" in routing
    assert "python -m bench.routing --quick" in routing and "Test CPU" in routing
    overhead = (results / "overhead.md").read_text()
    assert "1.040" in overhead  # TTFT p50 ratio 0.0104 / 0.010
    assert "1.020-1.060" in overhead
    assert "16667 events per proxy CPU-second" in overhead
    assert "burst: failed: `firehose exited`" in overhead
    assert "sglang-router/round_robin" in overhead
    page = docs.read_text()
    assert "### Routing benchmark" in page and "### Overhead benchmark" in page
    assert page.index("### Targets at a glance") < page.index("### Routing benchmark")
    assert "(fraction 0.933) — **met**" in page
    if importlib.util.find_spec("matplotlib") is None:
        return
    assert (results / "routing.png").stat().st_size > 10000
    assert (results / "overhead.png").stat().st_size > 10000
    assert "](../results/routing.png)" in page


def test_report_without_results_says_how_to_get_them(tmp_path):
    docs = tmp_path / "benchmarks.md"
    report.main(["--results", str(tmp_path / "none"), "--docs", str(docs)])
    assert "run `python -m bench.routing`" in docs.read_text()


def test_fmt_renders_missing_values_as_a_dash():
    assert report.fmt(None) == "n/a" and report.fmt(math.nan) == "n/a"
    assert report.fmt(1.23456) == "1.235"


def _rounds(*p50s):
    return [{"ttft_p50": v} for v in p50s]


def test_overhead_target_is_checked_for_the_default_policy_and_round_robin():
    clean = {"completed": 100.0, "shed": 0.0, "failed": 0.0}
    level = {"direct": {"summary": _summary(0.02, ttft_p50=1.0), "rounds": _rounds(1.0, 1.0)},
             "kvproxy/expected_ttft": {"summary": _summary(0.02, ttft_p50=1.02, **clean),
                                       "rounds": _rounds(1.01, 1.03)},
             "kvproxy/prefix_affinity": {"summary": _summary(0.02, ttft_p50=1.0, **clean)}}
    text = overhead_targets({"64": level})
    assert ("`kvproxy/expected_ttft`, TTFT p50 ≤ 1.05 x direct at 64 streams: 1.020 (rounds "
            "1.010-1.030) — **met**" in text)
    assert "prefix_affinity" not in text
    assert ("`kvproxy/round_robin`, TTFT p50 ≤ 1.05 x direct at 64 streams: nan (rounds: not "
            "recorded) — not measured" in text)


def test_repeated_runs_are_judged_round_by_round(tmp_path):
    results = tmp_path / "results"
    write_json(results / "routing.json", ROUTING)
    rounds = [(6.0, 2.9, 3.5), (6.2, 3.2, 3.1), (5.8, 2.8, 3.0)]  # RR, kvproxy, best peer
    runs = []
    for i, (rr, ours, peer) in enumerate(rounds):
        runs += [{**_run("kvproxy/round_robin", rr, 0.1), "round": i},
                 {**_run("kvproxy/prefix_affinity", ours, (0.28, 0.275, 0.26)[i]), "round": i},
                 {**_run("sglang-router/cache_aware", peer, 0.27), "round": i}]
    write_json(results / "noise" / "routing.json", {**ROUTING, "runs": runs})
    report.main(["--results", str(results), "--docs", str(tmp_path / "page.md")])
    text = (results / "routing.md").read_text()
    assert "3 rounds" in text
    row = "| `kvproxy/prefix_affinity` | 2.90 / 3.20 / 2.80 | 2.90 | 0.280 / 0.275 / 0.260 |"
    assert row in text
    assert "0.483 / 0.516 / 0.483 — ≤ 0.5 in 2 of 3 rounds" in text
    assert "≥ 0.9 in 2 of 3 rounds" in text  # 0.933, 0.917, 0.867 of the ideal 0.3
    assert "below every peer's best in 2 of 3 rounds" in text


def test_without_repeated_runs_the_report_says_how_to_make_them(tmp_path):
    results = tmp_path / "results"
    write_json(results / "routing.json", ROUTING)
    report.main(["--results", str(results), "--docs", str(tmp_path / "page.md")])
    assert "--repeat 3" in (results / "routing.md").read_text()


def _level(ours_p50, ours_p99, steady, lag_s, stale, peer_p50=1.0, peer_p99=2.0):
    """Two rounds, each with the pooled figures, and no request lost."""
    clean = {"completed": 100.0, "shed": 0.0, "failed": 0.0}

    def rounds(p50, p99, tok_s):
        return [{"ttft_p50": p50, "ttft_p99": p99, "steady_tok_s": tok_s}] * 2

    return {
        "direct": {"summary": _summary(2.0), "steady_tok_s": 1000.0,
                   "rounds": rounds(2.0, 4.0, 1000.0)},
        "kvproxy/expected_ttft": {
            "summary": _summary(2.0, ttft_p50=ours_p50, ttft_p99=ours_p99, **clean),
            "steady_tok_s": steady, "rounds": rounds(ours_p50, ours_p99, steady),
            "proxy": {"loop_lag_p99_s": lag_s, "stale_samples": stale, "samples": 40}},
        "vllm-router/round_robin": {"summary": _summary(2.0, ttft_p50=peer_p50,
                                                        ttft_p99=peer_p99),
                                    "steady_tok_s": 990.0,
                                    "rounds": rounds(peer_p50, peer_p99, 990.0)},
    }


def test_high_concurrency_goals_are_judged_per_level_against_the_peer_and_direct():
    text = high_concurrency_targets({
        "64": _level(9.0, 9.0, 1.0, 1.0, 5),  # below 1,024 streams: not judged here
        "1024": _level(1.09, 2.4, 985.0, 0.019, 0),
        "2048": _level(1.2, 2.6, 970.0, 0.025, 1),
    })
    assert "at 64 streams" not in text
    assert ("`kvproxy/expected_ttft` at 1024 streams: TTFT p50 x `vllm-router/round_robin`'s "
            "≤ 1.1: 1.090 (rounds 1.090-1.090) — **met**; TTFT p99 x ≤ 1.25: 1.200 (rounds "
            "1.200-1.200) — **met**" in text)
    assert ("`kvproxy/expected_ttft` at 1024 streams: steady tokens/s x direct's ≥ 0.98: 0.985 "
            "(rounds 0.985-0.985) — **met**; event-loop lag p99 19.0 ms ≤ 20 ms — **met**; "
            "samples with a stale engine 0 of 40 — **met**" in text)
    assert ("2048 streams: TTFT p50 x `vllm-router/round_robin`'s ≤ 1.1: 1.200 (rounds "
            "1.200-1.200) — **not met**" in text)
    assert "TTFT p99 x ≤ 1.25: 1.300 (rounds 1.300-1.300) — **not met**" in text
    assert ("steady tokens/s x direct's ≥ 0.98: 0.970 (rounds 0.970-0.970) — **not met**; "
            "event-loop lag p99 25.0 ms ≤ 20 ms — **not met**; samples with a stale engine 1 of "
            "40 — **not met**" in text)


def test_a_goal_met_pooled_but_missed_in_a_round_is_not_met():
    level = _level(1.05, 2.2, 990.0, 0.01, 0)
    level["kvproxy/expected_ttft"]["rounds"] = [
        {"ttft_p50": 0.9, "ttft_p99": 2.0, "steady_tok_s": 1010.0},
        {"ttft_p50": 1.2, "ttft_p99": 2.6, "steady_tok_s": 970.0}]
    text = high_concurrency_targets({"1024": level})
    assert "TTFT p50 x `vllm-router/round_robin`'s ≤ 1.1: 1.050 (rounds 0.900-1.200) — " \
        "**not met in round(s) 2**" in text
    assert "TTFT p99 x ≤ 1.25: 1.100 (rounds 1.000-1.300) — **not met in round(s) 2**" in text
    assert "0.990 (rounds 0.970-1.010) — **not met in round(s) 2**" in text
    assert "**met**" in text  # the lag and the staleness, which have no rounds


def test_a_path_that_lost_requests_meets_no_goal():
    level = _level(1.0, 2.0, 1000.0, 0.01, 0)
    level["kvproxy/expected_ttft"]["summary"].update(requests=200.0, completed=197.0)
    text = high_concurrency_targets({"1024": level})
    assert "**met**" not in text
    assert text.count("**not met (3 of 200 requests failed)**") == 5
    direct = {"summary": _summary(0.02, ttft_p50=1.0)}
    shed = {"summary": _summary(0.02, ttft_p50=1.0, requests=50.0, completed=49.0)}
    assert "1.000 (rounds: not recorded) — **not met (1 of 50 requests failed)**" in \
        overhead_targets({"64": {"direct": direct, "kvproxy/round_robin": shed}})


def test_high_concurrency_goals_without_the_peer_or_the_watch_are_not_measured():
    level = _level(1.0, 2.0, 1000.0, 0.01, 0)
    del level["vllm-router/round_robin"]
    del level["kvproxy/expected_ttft"]["proxy"]
    del level["kvproxy/expected_ttft"]["steady_tok_s"]
    text = high_concurrency_targets({"1024": level})
    assert "**met**" not in text and "**not met**" not in text
    assert text.count("not measured") == 5


def test_a_level_plan_covers_a_whole_request_in_its_ramp_and_runs_waves_past_it():
    assert level_plan(6.0, 4.0, 10.0, 2.0) == (10.0, 30.0)  # long requests: a longer level
    assert level_plan(6.0, 4.0, 1.0, 2.0) == (4.0, 6.0)  # short ones: never below what was asked
    assert level_plan(6.0, 4.0, 10.0, 0.0) == (4.0, 6.0)  # 0 waves: fixed slices
    assert level_plan(6.0, 4.0, None, 2.0) == (4.0, 6.0)  # no request completed in the pilot


def test_a_saturated_engine_core_is_named_beside_the_throughput_verdict():
    level = _level(1.0, 2.0, 970.0, 0.01, 0)
    level["direct"]["cores_busy"] = {"cpu0": 0.2, "cpu1": 0.95}
    text = high_concurrency_targets({"2048": level}, engine_cores=["cpu1"])
    assert ("steady tokens/s x direct's ≥ 0.98: 0.970 (rounds 0.970-0.970) — **not met** (the "
            "engines' and load generator's core was 0.95 busy in direct's slices" in text)
    level["direct"]["cores_busy"] = {"cpu0": 0.2, "cpu1": 0.6}
    assert "busy in direct's" not in high_concurrency_targets({"2048": level},
                                                               engine_cores=["cpu1"])
