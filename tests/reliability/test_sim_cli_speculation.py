"""``kvproxy-sidecar sim --adaptive-speculation`` as a process: the controller's series are on each
speculating engine's ``/metrics`` (without the flag, only the derived acceptance series are)."""

from __future__ import annotations

import aiohttp
import pytest

from .procs import start_engine


@pytest.mark.parametrize("adaptive", [True, False])
async def test_the_simulator_runs_the_controller_only_when_asked(adaptive: bool) -> None:
    flags = ["--num-speculative-tokens", "3", "--time-scale", "20"]
    engine = await start_engine("spec", "sim-model",
                                *flags, *(["--adaptive-speculation"] if adaptive else []))
    try:
        async with aiohttp.ClientSession() as http, http.get(engine.url + "/metrics") as resp:
            text = await resp.text()
    finally:
        await engine.stop()
    assert "kvproxy_sidecar_spec_num_speculative_tokens 3" in text
    assert ("kvproxy_sidecar_spec_controller_acting 1" in text) is adaptive
    assert ('kvproxy_sidecar_spec_rollout_state{state="idle"} 1' in text) is adaptive
