"""The offline round-robin model runs on the simulator's scheduler (catches API drift)."""

import math

import pytest

from bench.calibrate import simulate_round_robin
from bench.traces import TraceRequest

pytest.importorskip("engine_sidecar.sim.scheduler")


def test_round_robin_model_serves_every_request_and_counts_hits():
    reqs = [TraceRequest(i, i * 0.5, 1100, 8, (0, 1, 2 + i % 2)) for i in range(6)]
    point = simulate_round_robin(reqs, engines=2, profile="llama70b-h100x4",
                                 num_gpu_blocks=None, rate_scale=1.0)
    assert point["ttft_p50"] > 0 and not math.isnan(point["ttft_p99"])
    assert 0.3 < point["hit_rate"] < 1.0  # later requests reuse the two shared blocks
    assert point["preemptions"] == 0
