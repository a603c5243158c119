"""The soak benchmark's pure parts (slopes, RSS summary, /proc readers) and its report."""

import os
import socket

from bench.report_soak import soak_markdown
from bench.soak import rss_mib, rss_summary, slope, upstream_sockets

MACHINE = {"nproc": 2, "cpu_model": "Test CPU", "kernel": "6", "python": "3.11",
           "memory_gib": 24.0, "load_avg_at_start": [0.5, 0.4, 0.3]}
SETTINGS = {"requests": 1000, "concurrency": 8, "max_tokens": 16, "abort_share": 0.3,
            "sample_s": 1.0, "streams": 20, "ramp_s": 1.0, "stall_s": 5.0, "window_s": 1.0,
            "proxy_cores": "0", "engine_cores": "1", "proxy_set": [],
            "fleet": {"engines": 2, "profile": "llama8b-h100", "time_scale": 200.0}}
AFTER = {"right_after": {"proxy_inflight_requests": 0.0, "upstream_connections": 6.0},
         "after_65s": {"proxy_inflight_requests": 0.0, "upstream_connections": 2.0},
         "rss_mib": 51.0}


def test_slope_is_least_squares_and_zero_without_spread():
    assert abs(slope([(0, 1.0), (1, 3.0), (2, 5.0)]) - 2.0) < 1e-12
    assert slope([(1, 1.0), (1, 9.0)]) == 0.0
    assert slope([]) == 0.0


def test_rss_summary_reports_start_peak_end_and_growth_per_10k():
    samples = [(float(t), t * 1000, 50.0 + t * 0.1) for t in range(20)]
    s = rss_summary(samples)
    assert (s["start_mib"], s["end_mib"]) == (50.0, samples[-1][2])
    assert s["peak_mib"] == samples[-1][2]
    assert abs(s["slope_mib_per_10k_requests"] - 1.0) < 1e-9


def test_proc_readers_see_this_process():
    assert rss_mib(os.getpid()) > 1
    assert upstream_sockets(os.getpid(), {1}) == 0
    # One established connection of this process to a listener: counted by the listener's port,
    # not by any other (the accepted end's remote port is the client's own).
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            with accepted:
                assert upstream_sockets(os.getpid(), {port}) == 1


def test_report_shows_every_run_and_the_memory_comparison():
    churn = {"command": "python -m bench.soak churn", "machine": MACHINE, "settings": SETTINGS,
             "requests_done": 1000, "elapsed_s": 2.0, "requests_per_s": 500.0, "completed": 700,
             "aborted": 300, "errors": 0, "cut_short": True, "after": AFTER,
             "rss": {"start_mib": 50.0, "peak_mib": 60.0, "end_mib": 59.0,
                     "slope_mib_per_10k_requests": 1.5,
                     "slope_mib_per_10k_requests_second_half": 1.25}}
    index0 = {**churn, "settings": {**SETTINGS, "proxy_set": ["routing.index_blocks=0"]}}
    text = soak_markdown({"churn": churn, "churn-index0": index0})
    assert "| 1000 | 2.0 | 500 | 700 | 300 | 0 | 50.0 | 60.0 | 59.0 | 1.50 | 1.25 |" in text
    assert "cut short" in text and "`routing.index_blocks=0`" in text
    assert "## Where the memory goes" in text and "| `churn` | defaults | 9.0 | 1.25 |" in text
    assert "No idle-streams run yet: `python -m bench.soak idle`." in text
