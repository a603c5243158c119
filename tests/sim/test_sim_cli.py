"""``kvproxy-sidecar sim``: flags, and draining on SIGTERM in a real process."""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from engine_sidecar.sim.main import add_arguments, configs_from_args, run

from .conftest import chat_body, metric, parse_sse


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_map_onto_engine_configs() -> None:
    args = _parse("--engines", "3", "--model", "m", "--profile", "llama70b-h100",
                  "--num-gpu-blocks", "100", "--block-size", "32", "--max-num-seqs", "4",
                  "--scheduling-policy", "priority", "--num-speculative-tokens", "2",
                  "--spec-acceptance", "0.9,0.5", "--legacy-kv-metric", "--seed", "10",
                  "--fault-error-rate", "0.25", "--fault-metrics-missing", "vllm:x",
                  "--time-scale", "4", "--name", "t",
                  "--fault-metric-override", "vllm:kv_cache_usage_perc=0.9")
    configs = configs_from_args(args)
    assert [c.seed for c in configs] == [10, 11, 12]
    first = configs[0]
    assert (first.model, first.profile, first.blocks, first.block_size) == (
        "m", "llama70b-h100", 100, 32)
    assert first.scheduling_policy == "priority" and first.legacy_kv_metric
    assert first.acceptance_per_pos == (0.9, 0.5)
    assert first.faults.error_rate == 0.25 and first.faults.metrics_missing == ("vllm:x",)
    assert configs[0].faults is not configs[1].faults
    assert first.faults.metric_overrides == {"vllm:kv_cache_usage_perc": 0.9}
    assert [c.name for c in configs] == ["t-0", "t-1", "t-2"]
    assert configs_from_args(_parse("--name", "solo"))[0].name == "solo"
    with pytest.raises(ValueError, match="block_size"):
        configs_from_args(_parse("--block-size", "0"))


async def _read_urls(stream: asyncio.StreamReader, count: int) -> list[str]:
    urls: list[str] = []
    while len(urls) < count:
        line = (await asyncio.wait_for(stream.readline(), 20)).decode()
        assert line, "the simulator exited before serving"
        found = re.search(r"at (http://\S+)$", line.strip())
        if found:
            urls.append(found.group(1))
    return urls


async def test_sigterm_drains_then_exits(http: aiohttp.ClientSession) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine_sidecar", "sim", "--engines", "2", "--port", "0",
        "--time-scale", "5", "--drain-timeout", "20", stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stderr is not None
        urls = await _read_urls(proc.stderr, 2)
        # About 4 s of stream: still open while the drain is observed below.
        body = chat_body("stay with me", max_tokens=300, ignore_eos=True, stream=True)
        async with http.post(urls[0] + "/v1/chat/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(10):
                while await metric(http, urls[1], "kvproxy_sidecar_draining") != 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            async with http.post(urls[1] + "/v1/chat/completions", json=chat_body("new")) as r:
                assert r.status == 503
            events = parse_sse(await resp.read())
        assert events[-1] == "[DONE]"
        # Every token after the first event arrived: the drain cut nothing.
        assert len(events[:-1]) == 300 and events[-2]["choices"][0]["finish_reason"] == "length"
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_list_profiles_prints_the_derived_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_parse("--list-profiles")) == 0
    out = capsys.readouterr().out
    assert out.startswith("| profile |")
    assert "`llama8b-l4`" in out and "`llama70b-h100`" in out
    # docs/simulator.md shows the table as printed: a profile added or changed shows there too.
    docs = (Path(__file__).parents[2] / "docs" / "simulator.md").read_text()
    assert out.strip() in docs
