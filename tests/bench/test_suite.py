"""The routing suite: per-workload knee, its report (ratios to the best peer, rounds judged on
their own) and its place in docs/benchmarks.md."""

import pytest

from bench import report, suite
from bench.machine import write_json
from bench.report_suite import suite_markdown
from bench.routing import build_parser, loadgen_cores
from bench.suite_runs import best_peer
from bench.traces import Caps, apply_caps
from bench.workloads import rag

MACHINE = {"nproc": 2, "cpu_model": "Test CPU", "kernel": "6", "python": "3.11",
           "memory_gib": 24.0, "load_avg_at_start": [2.5, 2.4, 2.3]}


def test_knee_is_where_round_robin_ttft_turns_upward():
    reqs = apply_caps(rag(60.0), Caps(max_input_tokens=16896, max_output_tokens=64,
                                      output_scale=0.25))
    cal = suite.calibrate(reqs, engines=4, profile="llama70b-h100x4-kv8", num_gpu_blocks=None)
    assert cal.light["busy_fraction"] >= suite.LIGHT_BUSY * 0.9
    assert cal.knee_scale > cal.light["rate_scale"]
    limit = suite.KNEE_FACTOR * cal.light["ttft_p90"]
    assert cal.knee["ttft_p90"] >= limit
    below = [p for p in cal.points if p["rate_scale"] < cal.knee_scale]
    assert below[-1]["ttft_p90"] < limit  # the knee is bracketed from below...
    assert cal.knee_scale / below[-1]["rate_scale"] < 1.06  # ...to within about 5 %


def test_suite_options_parse_and_unknown_names_are_usage_errors():
    args = build_parser().parse_args(["--suite", "--quick", "--workloads", "rag,longdoc"])
    routers, workloads = suite.resolve(args)
    assert [w.name for w in workloads] == ["rag", "longdoc"]
    assert "kvproxy/prefix_affinity" in [r.name for r in routers]
    with pytest.raises(ValueError, match="unknown workload"):
        suite.resolve(build_parser().parse_args(["--suite", "--workloads", "nope"]))


def test_the_load_generator_is_unpinned_unless_cores_are_named():
    assert loadgen_cores(build_parser().parse_args(["--suite"])) is None
    named = build_parser().parse_args(["--suite", "--loadgen-cores", "1"])
    assert loadgen_cores(named) == "1"
    settings = suite.skeleton(named, [])["settings"]
    assert isinstance(settings, dict) and settings["loadgen_cores"] == "1"


def _run(workload, router, p90, hit, rnd=0, status="ok"):
    if status != "ok":
        return {"workload": workload, "round": rnd, "router": router, "status": status,
                "error": "not installed"}
    return {"workload": workload, "round": rnd, "router": router, "status": "ok",
            "summary": {"requests": 10.0, "completed": 10.0, "ttft_p50": p90 / 2,
                        "ttft_p90": p90, "ttft_p99": 2 * p90, "itl_p99": 0.05},
            "hit_rate": hit, "engine_requests": {"a": 6.0, "b": 2.0}, "router_cpu_s": 3.0,
            "duration_s": 10.0}


def _workload(name, oracle):
    return {"name": name, "title": f"the {name} shape", "slice_s": 120.0,
            "max_input_tokens": 16384, "rate_scale": 3.0, "compression": 9.0,
            "trace": {"requests": 10, "span_s": 90.0, "rate_per_s": 0.11,
                      "mean_input_tokens": 5000.0, "max_input_tokens": 9000,
                      "mean_output_tokens": 50.0, "ideal_hit_rate": oracle,
                      "round_robin_infinite_hit_rate": 0.1, "oracle_hit_rate": oracle},
            "calibration": {"rule": "the rule", "light": {"rate_scale": 0.5, "ttft_p90": 1.0},
                            "knee": {"rate_scale": 3.0, "ttft_p90": 2.5},
                            "points": [{"rate_scale": 3.0, "ttft_p90": 2.5}]}}


SUITE = {
    "benchmark": "routing-suite", "command": "python -m bench.routing --suite --quick",
    "started_at": "2026-01-01 00:00:00 UTC", "finished_at": "2026-01-01 00:15:00 UTC",
    "machine": MACHINE, "versions": {"kvproxy": "0.1.0"},
    "settings": {"quick": True, "repeat": 2, "time_scale": 3.0, "engines": 8,
                 "profile": "llama70b-h100x4-kv8", "num_gpu_blocks": None,
                 "max_output_tokens": 256, "output_scale": 0.25, "engine_cores": "1",
                 "router_cores": "0", "loadgen_cores": "unpinned"},
    "workloads": [_workload("rag", 0.8), _workload("unique", 0.0)],
    "runs": [
        _run("rag", "kvproxy/expected_ttft", 2.0, 0.6),
        _run("rag", "vllm-router/cache_aware", 4.0, 0.7),
        _run("rag", "sglang-router/cache_aware", 3.0, 0.72),
        _run("rag", "litellm/least-busy", 0, 0, status="unavailable"),
        _run("rag", "kvproxy/expected_ttft", 5.0, 0.6, rnd=1),
        _run("rag", "sglang-router/cache_aware", 4.0, 0.7, rnd=1),
        _run("unique", "kvproxy/expected_ttft", 1.0, 0.0),
        _run("unique", "sglang-router/cache_aware", 1.0, 0.0),
    ],
}


def test_best_peer_is_the_lowest_p90_peer_of_that_round():
    rag_round0 = [r for r in SUITE["runs"] if r["workload"] == "rag" and r["round"] == 0]
    assert best_peer(rag_round0)["router"] == "sglang-router/cache_aware"
    assert best_peer([r for r in rag_round0 if r["router"].startswith("kvproxy")]) is None


def test_report_gives_ratios_to_the_best_peer_round_by_round():
    text = suite_markdown(SUITE)
    summary = text.split("## Summary")[1].split("## Workload")[0]
    row = next(line for line in summary.splitlines() if line.startswith("| `kvproxy/"))
    # rag: 2.0 / 3.0 in round 1, 5.0 / 4.0 in round 2; unique: 1.0 / 1.0
    assert "0.67 / 1.25" in row and "| 1.00 |" in row
    assert "`rag`: `kvproxy/expected_ttft` TTFT p90 below the best peer's in 1 of 2" in text
    assert "`unique`: `kvproxy/expected_ttft` TTFT p90 below the best peer's in 0 of 1" in text
    hit_matrix = summary.split("Prefix-cache hit rate")[1].split("TTFT p50")[0]
    assert "0.75 / 0.75" in hit_matrix and "n/a" in hit_matrix  # 0.6/0.8; unique has no oracle
    assert "## Workload `rag`: the rag shape" in text
    assert "| `litellm/least-busy` | 1 |" in text and "unavailable" in text
    assert "6 / 4 (1.50)" in text  # busiest engine / mean
    share = summary.split("Requests per engine")[1].split("Absolute")[0]
    assert "| `kvproxy/expected_ttft` | 1.50 / 1.50 | 1.50 |" in share


def test_docs_page_carries_the_suite_summary_and_links_the_tables(tmp_path):
    results = tmp_path / "results"
    write_json(results / "suite.json", SUITE)
    docs = tmp_path / "docs" / "benchmarks.md"
    report.main(["--results", str(results), "--docs", str(docs)])
    page = docs.read_text()
    assert "### Routing workload suite" in page and "#### Summary" in page
    assert "[suite.md](../results/suite.md)" in page
    assert "## Workload `rag`" not in page  # the per-workload tables stay in suite.md
    assert "## Workload `rag`" in (results / "suite.md").read_text()


def test_docs_page_without_suite_results_says_how_to_get_them(tmp_path):
    docs = tmp_path / "benchmarks.md"
    report.main(["--results", str(tmp_path), "--docs", str(docs)])
    assert "python -m bench.routing --suite" in docs.read_text()
