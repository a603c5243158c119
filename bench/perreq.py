"""Router CPU per request by prompt size: a + c * prompt_bytes, for long chat prompts.

Rules: one simulated fleet (``kvproxy-sidecar sim``, fast engines, fixed 40-token answers) and
one ``kvproxy serve`` (policy ``expected_ttft``) as subprocesses; this process sends unique chat
bodies of each prompt size, streamed, at a steady rate, and reads the proxy's CPU from
``/proc/<pid>/stat`` before and after each size, interleaving the sizes over ``--rounds``. Every
process it starts is stopped by its PID. Wall clock only paces the sender; the figure is CPU time.
``--pyspy FILE`` records the proxy with py-spy for the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

WORDS = [f"w{i}x" for i in range(5000)]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _body(tokens: int, rng: random.Random) -> bytes:
    # A shared system prefix and a unique tail, like the rag workload's documents.
    text = " ".join(rng.choice(WORDS) for _ in range(tokens))
    return json.dumps({"model": "sim-model", "stream": True, "max_tokens": 40,
                       "messages": [{"role": "system", "content": "You answer from documents."},
                                    {"role": "user", "content": text}]}).encode()


async def _one(http: aiohttp.ClientSession, url: str, body: bytes) -> None:
    async with http.post(url, data=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"status {r.status}: {await r.text()}")
        async for _ in r.content.iter_any():
            pass


async def _size(http: aiohttp.ClientSession, url: str, bodies: list[bytes], rate: float) -> None:
    tasks = []
    for body in bodies:
        tasks.append(asyncio.create_task(_one(http, url, body)))
        await asyncio.sleep(1 / rate)
    await asyncio.gather(*tasks)


async def drive(args: argparse.Namespace, pid: int, url: str) -> dict[int, list[float]]:
    rng = random.Random(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[int, list[float]] = {s: [] for s in sizes}
    out[0] = []  # idle: CPU ms per second with no request open
    async with aiohttp.ClientSession() as http:
        await _size(http, url, [_body(200, rng) for _ in range(20)], args.rate)  # warm up
        for _ in range(args.rounds):
            before = _cpu_s(pid)
            await asyncio.sleep(args.idle_s)
            out[0].append((_cpu_s(pid) - before) * 1000 / args.idle_s)
            for size in sizes:
                bodies = [_body(size, rng) for _ in range(args.requests)]
                await asyncio.sleep(0.5)
                before = _cpu_s(pid)
                await _size(http, url, bodies, args.rate)
                await asyncio.sleep(0.3)
                out[size].append((_cpu_s(pid) - before) * 1000 / args.requests)
    return out


def _fit(sizes: list[int], means: list[float], nbytes: list[float]) -> tuple[float, float]:
    n = len(sizes)
    mx, my = sum(nbytes) / n, sum(means) / n
    if n < 2:
        return my, 0.0
    cov = sum((x - mx) * (y - my) for x, y in zip(nbytes, means, strict=True))
    c = cov / sum((x - mx) ** 2 for x in nbytes)
    return my - c * mx, c


def _wait(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1000,8000,16000", help="prompt tokens, comma-separated")
    p.add_argument("--requests", type=int, default=60, help="requests per size per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=30.0, help="requests per second")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--idle-s", type=float, default=3.0, help="idle window per round (s)")
    p.add_argument("--port", type=int, default=18790)
    p.add_argument("--pyspy", default=None, help="py-spy speedscope/flamegraph output file")
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    p.add_argument("--cprofile", default=None, help="run the proxy under cProfile, into FILE")
    p.add_argument("--policy", default="expected_ttft")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="perreq-"))
    eport = args.port + 10
    urls = [f"http://127.0.0.1:{eport + i}" for i in range(args.engines)]
    lines = ["[server]", 'host = "127.0.0.1"', f"port = {args.port}", "", "[routing]",
             f'policy = "{args.policy}"', "", "[[pools]]", 'name = "target"', 'model = "sim-model"']
    for i, u in enumerate(urls):
        lines += ["", "[[pools.engines]]", f'name = "e{i}"', f'url = "{u}"']
    (work / "kvproxy.toml").write_text("\n".join(lines) + "\n")
    bindir = Path(sys.executable).parent
    sim = subprocess.Popen([str(bindir / "kvproxy-sidecar"), "sim", "--engines",
                            str(args.engines), "--port", str(eport), "--time-scale", "20",
                            "--profile", "llama70b-h100x4", "--num-gpu-blocks", "200000",
                            "--output-len", "40,40",
                            "--max-model-len", "40000", "--max-num-batched-tokens", "40000",
                            "--log-level", "warning"], stdout=subprocess.DEVNULL)
    profile = ["-m", "bench._cpuprof", args.cprofile] if args.cprofile else []
    log = (work / "proxy.log").open("w")
    proxy = subprocess.Popen([sys.executable, *(profile or ["-m", "proxy"]), "serve",
                              "--config", str(work / "kvproxy.toml")],
                             stdout=subprocess.DEVNULL, stderr=log)
    spy = None
    try:
        for u in urls:
            _wait(u + "/health", time.monotonic() + 30)
        _wait(f"http://127.0.0.1:{args.port}/ready", time.monotonic() + 30)
        if args.pyspy:
            mode = ["--native"] if args.native else ["--nonblocking"]
            spy = subprocess.Popen([str(bindir / "py-spy"), "record", "-r", "200", *mode,
                                    "-f", "speedscope" if args.pyspy.endswith(".json") else "raw",
                                    "-o", args.pyspy, "-p", str(proxy.pid)])
        url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
        out = asyncio.run(drive(args, proxy.pid, url))
    finally:
        if spy:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        for proc in (proxy, sim):
            proc.send_signal(signal.SIGTERM)
        for proc in (proxy, sim):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
    idle = out.pop(0)
    print(f"idle: {', '.join(f'{v:.1f}' for v in idle)} ms of CPU per second")
    sizes = sorted(out)
    rng = random.Random(0)
    nbytes = [len(_body(s, rng)) / 1000 for s in sizes]
    for s, kb in zip(sizes, nbytes, strict=True):
        runs = ", ".join(f"{v:.2f}" for v in out[s])
        print(f"{s:>6} tokens {kb:6.1f} KB: best {min(out[s]):.2f} ms  per round [{runs}]")
    a, c = _fit(sizes, [min(out[s]) for s in sizes], nbytes)
    print(f"fit over best: a = {a:.2f} ms, c = {c * 1000:.1f} us per KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
