"""Router CPU per request by prompt size: a + c * prompt_bytes, for long chat prompts.

Rules: one simulated fleet (``kvproxy-sidecar sim``, fast engines, fixed 40-token answers) and
one ``kvproxy serve`` (policy ``expected_ttft``) as subprocesses; this process sends unique chat
bodies of each prompt size, streamed, at a steady rate, and reads the proxy's CPU from
``/proc/<pid>/stat`` before and after each size, interleaving the sizes over ``--rounds``. Every
process it starts is stopped by its PID. Wall clock only paces the sender; the figure is CPU time.
``--pyspy FILE`` records the proxy with py-spy for the whole run.

``--idle ARMS``: idle CPU only. The same fleet and the routers named in ARMS (``kvproxy``, this
tree; ``kvproxy@DIR``, the tree in DIR, e.g. a ``git archive`` of an older commit; a peer as
``vllm-router/cache_aware``) run side by side with no request at all, and each one's CPU is read
from ``/proc/<pid>/task/*/schedstat`` (nanoseconds, not 10 ms ticks) over the same ``--windows``
windows of ``--idle-s``: every arm measured in the same seconds, so a ratio per window cancels
what the machine's other load does to them all. ``--pyspy FILE`` records the first arm.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from bench.peers import Router, _kvproxy, launch_ready
from bench.procs import Managed, descendants, free_port, free_port_range, stop_all

WORDS = [f"w{i}x" for i in range(5000)]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_ns(pid: int) -> tuple[int, int]:
    """CPU time that ``pid``'s live threads and its children's have run, in nanoseconds (a
    launcher may hand the work to a child), and how many times they went to sleep (wake-ups)."""
    total = sleeps = 0
    for proc in (pid, *descendants(pid)):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{proc}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int((task / "schedstat").read_text().split()[0])
                    status = (task / "status").read_text()
                    at = status.index("voluntary_ctxt_switches:") + 24
                    sleeps += int(status[at : status.index("\n", at)])
    return total, sleeps


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


def _sim(args: argparse.Namespace, eport: int) -> subprocess.Popen[bytes]:
    bindir = Path(sys.executable).parent
    return subprocess.Popen([str(bindir / "kvproxy-sidecar"), "sim", "--engines",
                             str(args.engines), "--port", str(eport), "--time-scale", "20",
                             "--profile", "llama70b-h100x4", "--num-gpu-blocks", "200000",
                             "--output-len", "40,40",
                             "--max-model-len", "40000", "--max-num-batched-tokens", "40000",
                             "--log-level", "warning"], stdout=subprocess.DEVNULL)


def _arm(spec: str, urls: list[str], work: Path) -> Managed:
    """Start the router named ``spec`` (see ``--idle``) in front of ``urls``, ready."""
    name, _, tree = spec.partition("@")
    if name != "kvproxy":
        router, _, policy = name.partition("/")
        proc, _ = launch_ready(Router(router, policy), urls, "sim-model", work / name, None)
        return proc
    port, arm_dir = free_port(), work / spec.replace("/", "_")
    arm_dir.mkdir(parents=True)
    argv, env, ready, _ = _kvproxy(Router("kvproxy", "expected_ttft"), urls, "sim-model", port,
                                   arm_dir)
    if tree:  # that tree's package first: run from inside it (``-m`` puts the cwd first)
        argv = ["env", "-C", str(Path(tree).resolve()), *argv]
    proc = Managed(spec, argv, arm_dir / "kvproxy.log", env=env).start()
    proc.wait_http(ready, timeout_s=60)
    return proc


def idle_main(args: argparse.Namespace) -> int:
    """Idle CPU of every arm in ``args.idle``, side by side, in ms of CPU per second."""
    work = Path(tempfile.mkdtemp(prefix="idle-"))
    eport = free_port_range(args.engines)
    urls = [f"http://127.0.0.1:{eport + i}" for i in range(args.engines)]
    specs = args.idle.split(",")
    sim, arms, spy = _sim(args, eport), [], None
    try:
        for u in urls:
            _wait(u + "/health", time.monotonic() + 30)
        arms = [_arm(spec, urls, work) for spec in specs]
        time.sleep(args.settle_s)
        if args.pyspy:
            spy = _spy(args, arms[0].pid)
        rows = _idle_windows([a.pid for a in arms] + [sim.pid], args)
    finally:
        if spy:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        stop_all(arms)
        sim.send_signal(signal.SIGTERM)
        sim.wait(20)
    _idle_report([*specs, "(engines)"], rows)
    return 0


def _spy(args: argparse.Namespace, pid: int) -> subprocess.Popen[bytes]:
    bindir = Path(sys.executable).parent
    mode = ["--native"] if args.native else ["--nonblocking"]
    return subprocess.Popen([str(bindir / "py-spy"), "record", "-r", str(args.pyspy_rate), *mode,
                             "-f", "speedscope" if args.pyspy.endswith(".json") else "raw",
                             "-o", args.pyspy, "-p", str(pid)])


def _idle_windows(pids: list[int], args: argparse.Namespace) -> list[list[tuple[float, float]]]:
    """Per window, each pid's CPU in ms and its wake-ups, per second of wall clock."""
    rows = []
    for _ in range(args.windows):
        t0, before = time.monotonic(), [_run_ns(p) for p in pids]
        time.sleep(args.idle_s)
        after, t1 = [_run_ns(p) for p in pids], time.monotonic()
        rows.append([((b[0] - a[0]) / 1e6 / (t1 - t0), (b[1] - a[1]) / (t1 - t0))
                     for a, b in zip(before, after, strict=True)])
    return rows


def _idle_report(names: list[str], windows: list[list[tuple[float, float]]]) -> None:
    print(f"idle CPU, ms per second, {len(windows)} windows; load average {os.getloadavg()}")
    rows = [[cpu for cpu, _ in w] for w in windows]
    for i, name in enumerate(names):
        wakes = sorted(w[i][1] for w in windows)
        print(f"{name:>32}: wake-ups per second, median {wakes[len(wakes) // 2]:.0f}")
        vals = sorted(r[i] for r in rows)
        ratios = sorted(r[i] / r[0] for r in rows if r[0] > 0)
        print(f"{name:>32}: median {vals[len(vals) // 2]:6.2f}  min {vals[0]:6.2f}  "
              f"max {vals[-1]:6.2f}  | / {names[0]}: median {ratios[len(ratios) // 2]:.3f} "
              f"[{ratios[0]:.3f}, {ratios[-1]:.3f}]  windows: "
              + " ".join(f"{r[i]:.2f}" for r in rows))


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
    p.add_argument("--idle", default="", help="idle CPU only, of these routers side by side: "
                   "kvproxy, kvproxy@DIR, vllm-router/cache_aware, ...")
    p.add_argument("--windows", type=int, default=6, help="--idle: windows of --idle-s")
    p.add_argument("--settle-s", type=float, default=5.0, help="--idle: wait before measuring")
    p.add_argument("--pyspy-rate", type=int, default=200)
    args = p.parse_args()
    if args.idle:
        return idle_main(args)
    work = Path(tempfile.mkdtemp(prefix="perreq-"))
    eport = args.port + 10
    urls = [f"http://127.0.0.1:{eport + i}" for i in range(args.engines)]
    lines = ["[server]", 'host = "127.0.0.1"', f"port = {args.port}", "", "[routing]",
             f'policy = "{args.policy}"', "", "[[pools]]", 'name = "target"', 'model = "sim-model"']
    for i, u in enumerate(urls):
        lines += ["", "[[pools.engines]]", f'name = "e{i}"', f'url = "{u}"']
    (work / "kvproxy.toml").write_text("\n".join(lines) + "\n")
    sim = _sim(args, eport)
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
            spy = _spy(args, proxy.pid)
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
