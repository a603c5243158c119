"""The simulated engine fleet of a benchmark: one process serving N engines, and their counters.

Rules:
- All engines run in ONE separate process (``python -m engine_sidecar sim --engines N``), pinned
  to the cores given; a fresh process per benchmark run gives every run cold KV caches.
- Engines listen on consecutive ports from a base port; their URLs are known before they start.
- Counters are read from each engine's own ``/metrics`` (vLLM names), summed over label sets;
  a run's figures are differences of two scrapes, so nothing before the run counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.procs import Managed, free_port_range, http_get

COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
)


@dataclass(frozen=True)
class FleetSpec:
    engines: int = 8
    profile: str = "llama70b-h100x4"
    model: str = "llama-70b"
    time_scale: float = 1.0
    num_gpu_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    extra_args: tuple[str, ...] = ()

    def argv(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "engine_sidecar", "sim", "--engines", str(self.engines),
                "--host", "127.0.0.1", "--port", str(port), "--model", self.model,
                "--profile", self.profile, "--time-scale", repr(self.time_scale)]
        optional = {
            "--num-gpu-blocks": self.num_gpu_blocks,
            "--max-model-len": self.max_model_len,
            "--max-num-seqs": self.max_num_seqs,
            "--max-num-batched-tokens": self.max_num_batched_tokens,
        }
        for flag, value in optional.items():
            if value is not None:
                argv += [flag, str(value)]
        return argv + list(self.extra_args)

    def settings(self) -> dict[str, object]:
        return {
            "engines": self.engines, "profile": self.profile, "model": self.model,
            "time_scale": self.time_scale, "num_gpu_blocks": self.num_gpu_blocks,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }


@dataclass
class Fleet:
    spec: FleetSpec
    log_dir: Path
    cores: str | None = None
    port: int = 0
    proc: Managed | None = None
    urls: list[str] = field(default_factory=list)

    def start(self, timeout_s: float = 60.0, attempts: int = 3) -> Fleet:
        """Start the engine process; a lost race for a port is retried on another range."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        return self

    def _start_once(self, timeout_s: float) -> Fleet:
        self.port = free_port_range(self.spec.engines)
        self.urls = [f"http://127.0.0.1:{self.port + k}" for k in range(self.spec.engines)]
        self.proc = Managed("sim-engines", self.spec.argv(self.port),
                            self.log_dir / "sim-engines.log", cores=self.cores).start()
        for url in self.urls:
            self.proc.wait_http(url + "/health", timeout_s=timeout_s)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def kv_config(self) -> dict[str, str]:
        """The first engine's cache configuration as it reports it (all engines are alike)."""
        status, text = http_get(self.urls[0] + "/metrics", timeout_s=5.0)
        return cache_config(text) if status == 200 else {}

    def scrape(self) -> dict[str, dict[str, float]]:
        """Counters of every engine, keyed by engine URL."""
        out: dict[str, dict[str, float]] = {}
        for url in self.urls:
            status, text = http_get(url + "/metrics", timeout_s=5.0)
            out[url] = parse_counters(text) if status == 200 else {}
        return out


def cache_config(text: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...); {} if absent."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = line[line.index("{") + 1 : line.rindex("}")]
            return dict(re.findall(r'(\w+)="([^"]*)"', labels))
    return {}


def parse_counters(text: str, names: Sequence[str] = COUNTERS) -> dict[str, float]:
    """Sum of every sample of each named series (all label sets); absent series are 0."""
    wanted = set(names)
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        if name in wanted:
            try:
                sums[name] += float(value)
            except ValueError:
                continue
    return sums


def deltas(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    return {
        url: {k: after[url].get(k, 0.0) - before.get(url, {}).get(k, 0.0) for k in after[url]}
        for url in after
    }


def fleet_hit_rate(delta: Mapping[str, Mapping[str, float]]) -> float:
    hits = sum(d.get("vllm:prefix_cache_hits_total", 0.0) for d in delta.values())
    queries = sum(d.get("vllm:prefix_cache_queries_total", 0.0) for d in delta.values())
    return hits / queries if queries > 0 else float("nan")


def requests_per_engine(delta: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    return {url: d.get("vllm:request_success_total", 0.0) for url, d in delta.items()}


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass
class GaugeSampler:
    """Samples every engine's running/waiting/KV gauges while a run goes on (evidence of load)."""

    urls: Sequence[str]
    interval_s: float = 1.0
    samples: list[dict[str, float]] = field(default_factory=list)  # one per engine per tick

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while not stop.is_set():
                for url in self.urls:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with session.get(url + "/metrics") as resp:
                            self.samples.append(parse_counters(await resp.text(), GAUGES))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)

    def summary(self) -> dict[str, float]:
        """Means over engines and ticks, and the share of samples with a waiting queue."""
        n = len(self.samples)
        if not n:
            return {}
        running = [s["vllm:num_requests_running"] for s in self.samples]
        waiting = [s["vllm:num_requests_waiting"] for s in self.samples]
        kv = [s["vllm:kv_cache_usage_perc"] for s in self.samples]
        return {
            "samples": float(n),
            "mean_running": sum(running) / n,
            "mean_waiting": sum(waiting) / n,
            "max_waiting": max(waiting),
            "queued_fraction": sum(1 for w in waiting if w > 0) / n,
            "mean_kv_usage": sum(kv) / n,
            "max_kv_usage": max(kv),
        }
