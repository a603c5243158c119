"""The overhead benchmark's measurement code, without engines or routers: what it counts."""

import asyncio
from types import SimpleNamespace

import pytest

from bench import fit, overhead
from bench.stats import RequestRecord


class TreeProc:
    """A router whose parent process does nothing and whose workers take 1 s per reading."""

    def __init__(self) -> None:
        self.tree = 0.0

    def cpu_seconds(self) -> float:
        return 0.0

    def tree_cpu_seconds(self) -> float:
        self.tree += 1.0
        return self.tree


def _started(name, proc):
    return [(SimpleNamespace(name=name), proc, None)]


def test_a_slice_charges_a_router_the_cpu_of_its_whole_process_tree(monkeypatch):
    async def loop(*args, **kwargs):
        return [RequestRecord(index=0, status=200, ttft=0.1)], 1.0

    monkeypatch.setattr(overhead, "closed_loop", loop)
    proc = TreeProc()
    _, _, used = asyncio.run(overhead._slice(None, None, _started("kvproxy/x+w2", proc),
                                             "kvproxy/x+w2", 4, 1.0, 0.0, 0.5))
    assert used == 1.0


def test_idle_cpu_is_the_whole_process_tree_s(monkeypatch):
    monkeypatch.setattr(fit, "IDLE_S", 0.01)
    rates = asyncio.run(fit.idle_rates(_started("kvproxy/x+w2", TreeProc())))
    assert rates["kvproxy/x+w2"] > 0


def _rec(sent_at, ttft, ok=True, tokens=4):
    return RequestRecord(index=0, sent_at=sent_at, status=200 if ok else 503,
                         ttft=ttft if ok else None, itl=[0.01] * 3 if ok else [],
                         e2e=ttft + 0.03 if ok else None, output_tokens=tokens if ok else 0)


def test_latency_counts_only_requests_sent_past_the_ramp_like_the_steady_rate(monkeypatch):
    # Sent during the ramp (at 10.0-10.9, ramp 1 s from 10.0): fast, the load still light.
    # Sent from 11.0 on: the level's own load, slow.
    rounds = iter([
        [_rec(10.0, 0.01), _rec(10.5, 0.01), _rec(11.0, 0.5), _rec(11.5, 0.7)],  # direct
        [_rec(20.0, 0.01), _rec(20.9, 0.01), _rec(21.0, 0.6), _rec(21.2, 0.8)],  # kvproxy
        [_rec(30.0, 0.01), _rec(31.0, 0.4), _rec(31.5, 0.6), _rec(31.6, 0.1, ok=False)],
        [_rec(40.0, 0.01), _rec(41.0, 1.0), _rec(41.5, 1.2), _rec(41.9, 1.4)],
    ])

    async def one_slice(*args, **kwargs):
        return next(rounds), 2.0, 0.0

    monkeypatch.setattr(overhead, "_slice", one_slice)
    started = [(SimpleNamespace(name="kvproxy/round_robin"), None, None)]
    level = asyncio.run(overhead.measure_level(None, None, started, 4, 2, 2.0, 1.0))
    direct, ours = level["direct"], level["kvproxy/round_robin"]
    # 0.5, 0.7, 0.4, 0.6: the ramp's 0.01 s left out (with them the median would be 0.45)
    assert direct["summary"]["ttft_p50"] == pytest.approx(0.55)
    assert ours["summary"]["ttft_p50"] == 1.0  # 0.6, 0.8, 1.0, 1.2, 1.4
    assert ours["summary"]["latency_requests"] == 5
    # Counts keep every request, the ramp's and the failed one's.
    assert direct["summary"]["requests"] == 8 and direct["summary"]["completed"] == 7
    assert [r["ttft_p50"] for r in direct["rounds"]] == pytest.approx([0.6, 0.5])
    assert [r["failed"] for r in direct["rounds"]] == [0, 1]
    assert ours["round_ttft_p50_ratios"] == pytest.approx([0.7 / 0.6, 1.2 / 0.5])


def test_a_round_s_figures_keep_p99_and_the_steady_rate():
    recs = [_rec(0.0, 0.01), _rec(1.0, 0.2), _rec(1.5, 0.4)]
    figures = overhead.round_figures(recs, 1.0, 3.0)
    assert figures["ttft_p50"] == pytest.approx(0.3)  # 0.2 and 0.4: the ramp's 0.01 left out
    assert figures["ttft_p99"] == pytest.approx(0.398)
    assert figures["steady_tok_s"] == 8 / 2.0  # every event of the two late requests, in [1, 3)
    assert figures["sent"] == 3 and figures["completed"] == 3 and figures["failed"] == 0


def test_the_report_says_which_requests_the_latency_is_taken_over():
    from bench.report_overhead import overhead_settings  # noqa: PLC0415

    settings = {"fleet": {"engines": 8, "profile": "p", "time_scale": 1.0}, "rounds": 2,
                "slice_s": 2.0, "prompt_tokens": 256, "output_tokens": 64, "engine_cores": "1",
                "router_cores": "0", "loadgen_cores": "1", "ramp_s": 4.0,
                "latency_after_ramp": True}
    assert "only requests sent at or after their slice's ramp ended" in overhead_settings(
        {"settings": settings})
    del settings["latency_after_ramp"]
    assert "those sent during the ramp included" in overhead_settings({"settings": settings})


def test_a_default_run_measures_the_policy_the_targets_judge():
    from bench.targets import OVERHEAD_ROUTERS  # noqa: PLC0415

    routers = overhead.build_parser().parse_args([]).routers.split(",")
    assert set(OVERHEAD_ROUTERS) <= set(routers)
    assert "kvproxy/expected_ttft" in OVERHEAD_ROUTERS  # the proxy's default (RoutingConfig)


def test_the_results_table_shows_requests_sent_completed_and_failed():
    from bench.report_overhead import OVERHEAD_HEADER, overhead_rows  # noqa: PLC0415

    summary = {"requests": 120.0, "completed": 117.0, "ttft_p50": 0.1}
    rows = overhead_rows({"levels": {"64": {"direct": {"summary": summary}}}})
    column = OVERHEAD_HEADER.index("requests sent / completed / failed")
    assert rows[0][column] == "120 / 117 / 3"


def test_the_report_says_kvproxy_s_cpu_carries_the_sampler_s_renders():
    from bench.report_overhead import renders_text  # noqa: PLC0415

    level = {"direct": {}, "kvproxy/round_robin": {"cpu_metrics_renders_per_request": 0.0125}}
    text = renders_text({"levels": {"1024": level}})
    assert "`kvproxy/round_robin` at 1024 streams 0.013" in text
    assert "includes the `/metrics` renders" in text
    assert renders_text({"levels": {"64": {"direct": {}}}}) == ""


def test_a_slice_counts_the_sampler_s_renders_and_the_fit_runs_no_sampler(monkeypatch):
    seen = []

    async def one_slice(session, paths, started, name, conc, slice_s, start, ramp_s,
                        watch=None, *rest):
        seen.append(watch)
        if watch is not None:
            watch.samples += 3
            watch.missed += 1
        return [_rec(0.0, 0.1), _rec(2.0, 0.1)], 2.0, 0.5

    monkeypatch.setattr(overhead, "_slice", one_slice)
    started = [(SimpleNamespace(name="kvproxy/round_robin"), None, None)]
    level = asyncio.run(overhead.measure_level(None, None, started, 2, 1, 3.0, 1.0))
    assert level["kvproxy/round_robin"]["cpu_metrics_renders_per_request"] == 2.0  # 4 of 2
    assert "cpu_metrics_renders_per_request" not in level["direct"]
    seen.clear()
    monkeypatch.setattr(fit, "IDLE_S", 0.01)
    proc = TreeProc()
    paths = overhead.Paths(["http://e"], "m", 8, 8)
    asyncio.run(fit.measure_fit(paths, [(SimpleNamespace(name="kvproxy/round_robin"), proc,
                                         None)], [16, 256], 2, 1, 3.0, 1.0))
    assert seen == [None, None]


def test_without_per_round_figures_a_pooled_ratio_is_not_called_met():
    from bench.targets import judged, overhead_targets  # noqa: PLC0415

    assert judged(1.0, [], 1.05, below=True) == \
        "1.000 (rounds: not recorded) — met pooled, not judged per round"
    # Older results kept the 64-stream TTFT ratios per round: they are judged from those.
    clean = {"requests": 10.0, "completed": 10.0, "ttft_p50": 1.0}
    level = {"direct": {"summary": clean},
             "kvproxy/round_robin": {"summary": clean, "round_ttft_p50_ratios": [0.98, 1.07]}}
    assert "1.000 (rounds 0.980-1.070) — **not met in round(s) 2**" in overhead_targets(
        {"64": level})


def test_older_results_get_the_renders_per_request_from_the_sampler_s_tally():
    from bench.report_overhead import renders_text  # noqa: PLC0415

    entry = {"summary": {"completed": 400.0}, "proxy": {"samples": 98.0, "missed_samples": 2.0}}
    assert "`kvproxy/expected_ttft` at 64 streams 0.250" in renders_text(
        {"levels": {"64": {"kvproxy/expected_ttft": entry}}})


def test_fixed_slices_no_longer_than_the_ramp_are_refused_before_anything_starts(capsys):
    # --quick's 3 s slices with the 4 s default ramp would leave no request past the ramp.
    with pytest.raises(SystemExit):
        overhead.main(["--quick", "--steady-waves", "0"])
    assert "must exceed --ramp-s" in capsys.readouterr().err


def test_a_round_without_a_figure_is_named_in_the_range_and_not_met():
    from bench.targets import judged  # noqa: PLC0415

    assert judged(1.0, [0.9, float("nan"), 1.02], 1.05, below=True) == \
        "1.000 (rounds 0.900-1.020, 1 without a figure) — **not met in round(s) 2**"


def test_a_reference_path_that_lost_requests_is_named_under_the_verdicts():
    from bench.targets import high_concurrency_targets  # noqa: PLC0415

    def path(sent, done):
        return {"summary": {"requests": sent, "completed": done, "ttft_p50": 1.0,
                            "ttft_p99": 2.0}}

    level = {"direct": path(100.0, 100.0), "kvproxy/expected_ttft": path(100.0, 100.0),
             "vllm-router/round_robin": path(100.0, 96.0)}
    text = high_concurrency_targets({"1024": level})
    assert ("(`vllm-router/round_robin` at 1024 streams: 4 of 100 requests failed; its figures "
            "are over the completed ones)" in text)
    assert "`direct` at 1024" not in text
