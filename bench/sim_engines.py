"""Benchmark: one process serving N simulated engines x C concurrent streams on one CPU core.

Not a test. The engines run in a child process pinned to one core (``--engine-cpu``); the streaming
clients run in this process, pinned to another core (``--client-cpu``), with raw aiohttp so the
client side stays cheap. The engine process measures its event-loop lag (how late a 10 ms timer
fires) and its CPU time over the measured window; the clients count the tokens they receive.
Prints a Markdown block and writes it to ``bench/results/sim_engines-<UTC time>.md``.

    .venv/bin/python bench/sim_engines.py --engines 8 --streams 128 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

SYSTEM = "You are a helpful assistant for a routing benchmark. " * 12
T = TypeVar("T")
RESULTS = Path(__file__).resolve().parent / "results"


# -- engine process --------------------------------------------------------------------------------

async def _lag_monitor(samples: list[float], interval: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        await asyncio.sleep(interval)
        samples.append(loop.time() - began - interval)


def _generated(cluster: Any) -> int:
    return sum(e.scheduler.stats.generation_tokens for e in cluster.engines)


async def engine_main(args: argparse.Namespace) -> None:
    from engine_sidecar.sim.cluster import start_cluster  # noqa: PLC0415
    from engine_sidecar.sim.config import SimEngineConfig  # noqa: PLC0415
    from engine_sidecar.sim.main import tune_gc  # noqa: PLC0415

    configs = [SimEngineConfig(model="bench", profile=args.profile, time_scale=args.time_scale,
                               max_num_seqs=max(256, args.streams),
                               num_gpu_blocks=args.num_gpu_blocks, seed=i)
               for i in range(args.engines)]
    cluster = await start_cluster(configs, host="127.0.0.1", port=0)
    tune_gc()  # as ``kvproxy-sidecar sim`` does
    gc_pauses: list[float] = []
    gc.callbacks.append(_gc_timer(gc_pauses))
    samples: list[float] = []
    monitor = asyncio.create_task(_lag_monitor(samples), name="bench-lag-monitor")
    print(json.dumps({"urls": cluster.urls}), flush=True)
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.readline()  # "start"
    samples.clear()
    gc_pauses.clear()
    cpu0, wall0, gen0 = _cpu(), time.perf_counter(), _generated(cluster)
    await reader.readline()  # "stop"
    cpu1, wall1, gen1 = _cpu(), time.perf_counter(), _generated(cluster)
    steps = sorted(samples)
    print(json.dumps({
        "lag_p50_ms": 1000 * _pct(steps, 0.50), "lag_p99_ms": 1000 * _pct(steps, 0.99),
        "lag_max_ms": 1000 * (steps[-1] if steps else 0.0),
        "gc_max_ms": 1000 * max(gc_pauses, default=0.0), "gc_total_ms": 1000 * sum(gc_pauses),
        "cpu_share": (cpu1 - cpu0) / (wall1 - wall0),
        "generated_per_s": (gen1 - gen0) / (wall1 - wall0),
        "running": sum(e.num_running for e in cluster.engines),
        "waiting": sum(e.num_waiting for e in cluster.engines),
    }), flush=True)
    monitor.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await monitor
    await cluster.close()


def _gc_timer(pauses: list[float]) -> Any:
    began = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - began[0])

    return callback


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# -- client process --------------------------------------------------------------------------------

@dataclass
class ClientStats:
    measuring: bool = False
    tokens: int = 0
    completed: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)


async def _one_stream(http: aiohttp.ClientSession, url: str, body: bytes, stats: ClientStats
                      ) -> None:
    began = time.perf_counter()
    first = True
    async with http.post(url + "/v1/chat/completions", data=body,
                         headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            stats.errors += 1
            await resp.read()
            return
        async for chunk in resp.content.iter_any():
            n = chunk.count(b'"delta":{"content"')
            if n and first:
                first = False
                if stats.measuring:
                    stats.ttft.append(time.perf_counter() - began)
            if stats.measuring:
                stats.tokens += n
    if stats.measuring:
        stats.completed += 1


async def _client_loop(http: aiohttp.ClientSession, url: str, client: int, args: argparse.Namespace,
                       stats: ClientStats) -> None:
    turn = 0
    while True:
        content = f"{SYSTEM}\nUser {client} asks question {turn}: " + "tell me more " * 20
        body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": content}],
                           "max_tokens": args.max_tokens, "stream": True}).encode()
        try:
            await _one_stream(http, url, body, stats)
        except aiohttp.ClientError:
            stats.errors += 1
            await asyncio.sleep(0.1)
        turn += 1


async def client_main(args: argparse.Namespace) -> dict[str, Any]:
    engine = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--role", "engine", *_forward(args),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert engine.stdin is not None and engine.stdout is not None
    try:
        urls = json.loads(await engine.stdout.readline())["urls"]
        stats = ClientStats()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=None)) as http:
            tasks = [asyncio.create_task(_client_loop(http, url, i, args, stats))
                     for url in urls for i in range(args.streams)]
            await asyncio.sleep(args.warmup)
            stats.measuring = True
            engine.stdin.write(b"start\n")
            cpu0, wall0 = _cpu(), time.perf_counter()
            await asyncio.sleep(args.duration)
            stats.measuring = False
            cpu1, wall1 = _cpu(), time.perf_counter()
            engine.stdin.write(b"stop\n")
            server = json.loads(await engine.stdout.readline())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.wait_for(engine.wait(), 30)
    finally:
        if engine.returncode is None:
            engine.kill()
            await engine.wait()
    wall = wall1 - wall0
    ttft = sorted(stats.ttft)
    return {**server, "received_per_s": stats.tokens / wall, "completed": stats.completed,
            "errors": stats.errors, "client_cpu_share": (cpu1 - cpu0) / wall,
            "ttft_p50_ms": 1000 * _pct(ttft, 0.5), "ttft_p99_ms": 1000 * _pct(ttft, 0.99),
            "ttft_mean_ms": 1000 * statistics.fmean(ttft) if ttft else 0.0}


def _forward(args: argparse.Namespace) -> list[str]:
    return ["--engines", str(args.engines), "--streams", str(args.streams), "--profile",
            args.profile, "--time-scale", str(args.time_scale), "--engine-cpu",
            str(args.engine_cpu), *(["--num-gpu-blocks", str(args.num_gpu_blocks)]
                                    if args.num_gpu_blocks else [])]


# -- report ----------------------------------------------------------------------------------------

def _machine() -> str:
    model = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (f"{model}, {os.cpu_count()} logical CPUs, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def report(args: argparse.Namespace, r: dict[str, Any], command: str) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = [
        ("tokens/s received by clients", f"{r['received_per_s']:,.0f}"),
        ("tokens/s generated by engines", f"{r['generated_per_s']:,.0f}"),
        ("requests completed in window", f"{r['completed']:,}"),
        ("client errors", f"{r['errors']}"),
        ("event-loop lag p50 / p99 / max (ms)",
         f"{r['lag_p50_ms']:.2f} / {r['lag_p99_ms']:.2f} / {r['lag_max_ms']:.2f}"),
        ("garbage-collector pause max / total (ms)",
         f"{r['gc_max_ms']:.1f} / {r['gc_total_ms']:.0f}"),
        ("engine process CPU (share of its one core)", f"{100 * r['cpu_share']:.0f} %"),
        ("client process CPU (share of its core)", f"{100 * r['client_cpu_share']:.0f} %"),
        ("TTFT at the client p50 / p99 (ms)",
         f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}"),
        ("running / waiting at the end", f"{r['running']} / {r['waiting']}"),
    ]
    lines = [
        f"#### Simulator benchmark, {when}",
        "",
        f"- machine: {_machine()}",
        f"- command: `{command}`",
        f"- setup: {args.engines} engines x {args.streams} concurrent streams "
        f"({args.engines * args.streams} in all), profile `{args.profile}`, KV blocks "
        f"{args.num_gpu_blocks or 'from the profile'}, time scale "
        f"{args.time_scale}, max_tokens {args.max_tokens}; engines pinned to CPU "
        f"{args.engine_cpu}, clients to CPU {args.client_cpu}; {args.warmup:g} s warm-up, "
        f"{args.duration:g} s measured",
        "",
        "| measure | value |",
        "|---|---|",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("client", "engine"), default="client",
                   help=argparse.SUPPRESS)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--streams", type=int, default=128, help="concurrent streams per engine")
    p.add_argument("--profile", default="llama8b-l4")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV blocks per engine (default: what the profile's GPU holds)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--engine-cpu", type=int, default=0)
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument("--no-save", action="store_true", help="print only; write no results file")
    return p.parse_args(argv)


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> int:
    args = parse_args()
    if args.role == "engine":
        _pin(args.engine_cpu)
        run(engine_main(args))
        return 0
    _pin(args.client_cpu)
    result = run(client_main(args))
    command = shlex.join(["python", "bench/sim_engines.py", *sys.argv[1:]])
    text = report(args, result, command)
    print(text)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        (RESULTS / f"sim_engines-{stamp}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
