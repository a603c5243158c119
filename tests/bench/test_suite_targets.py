"""The suite's targets are judged from the results, round by round, and a p90 target below the
workload's idle floor is called unreachable beside the miss (never turned into a pass)."""

from bench.report_suite import suite_markdown
from bench.suite_runs import best_peer
from bench.suite_targets import judge, targets_section
from tests.bench.test_suite import SUITE, _run, _workload


def _verdict(run, runs, oracle=0.8, floor_p90=0.5):
    return judge(run, runs, oracle, floor_p90)[-1]


def test_every_target_met_is_met_and_each_miss_is_named():
    peer = _run("rag", "sglang-router/cache_aware", 4.0, 0.7)
    good = _run("rag", "kvproxy/expected_ttft", 3.0, 0.78)  # p90 0.75, p50 0.75, hit 0.975
    assert _verdict(good, [good, peer]) == "met"
    slow = _run("rag", "kvproxy/expected_ttft", 3.6, 0.78)  # p90 0.90 of the peer's
    assert _verdict(slow, [slow, peer]) == "not met: p90"
    cold = _run("rag", "kvproxy/expected_ttft", 3.0, 0.7)  # hit 0.875 of the oracle
    assert _verdict(cold, [cold, peer]) == "not met: hit"
    late = _run("rag", "kvproxy/expected_ttft", 3.0, 0.78)
    late["summary"]["ttft_p50"] = 2.5  # above the peer's 2.0
    assert _verdict(late, [late, peer]) == "not met: p50"


def test_precise_mode_is_held_to_the_higher_hit_share():
    peer = _run("rag", "sglang-router/cache_aware", 4.0, 0.7)
    run = _run("rag", "kvproxy/expected_ttft+precise", 3.0, 0.77)  # 0.9625 of the oracle
    assert _verdict(run, [run, peer]) == "not met: hit"
    plain = _run("rag", "kvproxy/expected_ttft", 3.0, 0.77)
    assert _verdict(plain, [plain, peer]) == "met"


def test_a_p90_target_below_the_floor_is_called_unreachable_and_still_missed():
    peer = _run("longdoc", "sglang-router/cache_aware", 6.6, 0.69)
    ours = _run("longdoc", "kvproxy/expected_ttft", 6.1, 0.69)  # 0.92 of the peer's p90
    row = judge(ours, [ours, peer], 0.7, 5.83)
    assert row[3] == "0.96"  # 0.85 x 6.6 = 5.61 s over the 5.83 s floor
    assert row[-1].startswith("not met: p90; the p90 target (5.61 s) is below the idle floor "
                              "(5.83 s): no router can meet it")
    # A floor under the target: an ordinary miss.
    assert judge(ours, [ours, peer], 0.7, 4.0)[-1] == "not met: p90"


def test_no_reuse_is_judged_against_the_best_of_all_routers():
    ours = _run("unique", "kvproxy/expected_ttft", 1.04, 0.0)
    other = _run("unique", "kvproxy/round_robin", 1.0, 0.0)
    peer = _run("unique", "sglang-router/cache_aware", 1.2, 0.0)
    assert _verdict(ours, [ours, other, peer], oracle=0.0) == "met"
    ours = _run("unique", "kvproxy/expected_ttft", 1.06, 0.0)
    assert _verdict(ours, [ours, other, peer], oracle=0.0) == "not met: p90"


def test_a_round_without_a_peer_is_not_measured():
    ours = _run("rag", "kvproxy/expected_ttft", 3.0, 0.78)
    failed = _run("rag", "sglang-router/cache_aware", 0, 0, status="unavailable")
    assert _verdict(ours, [ours, failed]) == "not measured"


def test_the_report_carries_the_judgement_per_round_and_the_floor():
    data = {**SUITE, "workloads": [{**_workload("rag", 0.8),
                                    "idle_floor": {"rule": "alone", "ttft_p50": 0.1,
                                                   "ttft_p90": 0.4, "ttft_p99": 0.9}},
                                   _workload("unique", 0.0)]}
    text = suite_markdown(data)
    assert "idle floor (`bench.idle_floor`: alone): TTFT p50 0.10 s, p90 0.40 s, p99 0.90 s" in text
    floor_matrix = text.split("idle floor (`bench.idle_floor`: the p90")[1].split("TTFT p50")[0]
    assert "| `kvproxy/expected_ttft` | 5.00 / 12.50 | n/a |" in floor_matrix  # 2.0, 5.0 over 0.4
    section = text.split("## Targets, judged per round")[1].split("## Workload")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    # rag round 1: 2.0 / 3.0 = 0.67, p50 1.0 / 1.5, hit 0.6 / 0.8 = 0.75: hit missed;
    # rag round 2: 5.0 / 4.0; unique: 1.0 against the best of all, 1.0.
    assert rows[0].startswith("| `rag` | 1 | `kvproxy/expected_ttft` | 0.667 | 0.667 | 0.750")
    assert rows[0].endswith("| 6.37 | 0 of 10 | not met: hit |")  # 0.85 x 3.0 / 0.4 = 6.375
    assert rows[1].endswith("not met: p90, p50, hit |")
    assert rows[2].startswith("| `unique` | 1 |") and rows[2].endswith("| met |")
    # Results from before the floor was computed: the column reads n/a, the verdicts stand.
    assert "| 0.667 | 0.667 | 0.750 (≥ 0.95) | n/a | 0 of 10 | not met: hit |" in targets_section(
        SUITE["workloads"], {("rag", 0): SUITE["runs"][:4]})


def _peers_split():
    """Two peers: one best on p90, the other best on p50 (as sglang and vllm on rag)."""
    tail = _run("rag", "vllm-router/cache_aware", 4.0, 0.7)  # p50 2.0, p90 4.0
    head = _run("rag", "sglang-router/cache_aware", 5.0, 0.7)
    head["summary"]["ttft_p50"] = 1.0  # p50 1.0, p90 5.0
    return tail, head


def test_each_percentile_is_held_against_the_peer_best_on_that_percentile():
    tail, head = _peers_split()
    ours = _run("rag", "kvproxy/expected_ttft", 3.0, 0.78)  # p90 3.0, p50 1.5
    row = judge(ours, [ours, tail, head], 0.8, 0.5)
    assert row[0] == "0.750"  # 3.0 over vllm's 4.0, the lowest p90
    assert row[1] == "1.500"  # 1.5 over sglang's 1.0, the lowest p50 (not vllm's 2.0)
    assert row[-1] == "not met: p50"
    assert best_peer([ours, tail, head], "ttft_p50") is head
    assert best_peer([ours, tail, head]) is tail


def test_the_report_divides_each_figure_by_the_peer_best_on_it():
    tail, head = _peers_split()
    ours = _run("rag", "kvproxy/expected_ttft", 3.0, 0.78)
    data = {**SUITE, "workloads": [_workload("rag", 0.8)], "runs": [ours, tail, head]}
    text = suite_markdown(data)
    summary = text.split("## Summary")[1].split("## Targets")[0]
    p50 = summary.split("TTFT p50 / the best peer's")[1].split("TTFT p99")[0]
    assert "| `kvproxy/expected_ttft` | 1.50 |" in p50
    assert "| `vllm-router/cache_aware` | 2.00 |" in p50
    assert "best on that figure" in summary
    rows = text.split("## Workload `rag`")[1]
    row = next(line for line in rows.splitlines() if line.startswith("| `kvproxy/"))
    # p50, p90, p99 (6.0 over 8.0), ITL, hit (0.78 over 0.7) to the best peer on each
    assert "| 1.50 | 0.75 | 0.75 | 1.00 | 1.11 |" in row


def _shed(run, missing):
    run["summary"].update(completed=run["summary"]["requests"] - missing, shed=float(missing))
    return run


def test_a_run_that_shed_or_failed_requests_is_not_met_whatever_its_percentiles():
    peer = _run("rag", "sglang-router/cache_aware", 4.0, 0.7)
    fast = _shed(_run("rag", "kvproxy/expected_ttft", 3.0, 0.78), 3)  # every figure met
    row = judge(fast, [fast, peer], 0.8, 0.5)
    assert row[-2:] == ["3 of 10 failed or shed", "not met (3 of 10 failed or shed)"]
    slow = _shed(_run("rag", "kvproxy/expected_ttft", 3.6, 0.78), 1)
    assert _verdict(slow, [slow, peer]) == "not met (1 of 10 failed or shed); p90 also missed"
    unique = _shed(_run("unique", "kvproxy/expected_ttft", 1.0, 0.0), 2)
    other = _run("unique", "kvproxy/round_robin", 1.0, 0.0)
    assert _verdict(unique, [unique, other], oracle=0.0) == "not met (2 of 10 failed or shed)"
    complete = _run("rag", "kvproxy/expected_ttft", 3.0, 0.78)
    assert judge(complete, [complete, peer], 0.8, 0.5)[-2:] == ["0 of 10", "met"]
    del complete["summary"]["completed"]  # no counts: completeness unknown
    assert _verdict(complete, [complete, peer]) == "not measured"


def test_the_report_shows_failed_or_shed_requests_beside_the_verdict_and_the_matrix():
    peer = _run("rag", "sglang-router/cache_aware", 4.0, 0.7)
    ours = _shed(_run("rag", "kvproxy/expected_ttft", 3.0, 0.78), 4)
    data = {**SUITE, "workloads": [_workload("rag", 0.8)], "runs": [ours, peer]}
    text = suite_markdown(data)
    section = text.split("## Targets, judged per round")[1].split("## Workload")[0]
    assert "| 4 of 10 failed or shed | not met (4 of 10 failed or shed) |" in section
    summary = text.split("## Summary")[1].split("## Targets")[0]
    assert "| `kvproxy/expected_ttft` | 0.75 (4 of 10 failed or shed) |" in summary
    assert ("`rag`: `kvproxy/expected_ttft` TTFT p90 below the best peer's in 0 of 1 rounds "
            "(1 with failed or shed requests, not counted)") in summary
