"""Benchmark: how much live, collector-tracked state kvproxy keeps per open stream.

Not a test. The proxy runs in this process (as ``kvproxy serve`` runs it: start-up heap frozen,
``server.gc_young_threshold`` applied); simulated engines run slowed down in a child process so
that streams stay open, and a second child opens N streams through the proxy and holds them. With
the N streams open (each has had its first byte), this process counts what the collector tracks
(``gc.get_objects()``) against the same proxy with no stream open, and reports per open stream:
the objects, the top types, and the split by where the type comes from (aiohttp and its
libraries, kvproxy, other). Builtin containers (dicts, lists, cells, ...) are charged to the
nearest non-builtin object that refers to them among the new objects, so a header dict counts
as aiohttp's and a ``Job``'s field dict as kvproxy's. It also times ``gc.collect(1)`` and
``gc.collect(2)`` with the streams open.

    python -m bench.perstream --streams 256,1024

Why in this process and not through ``/metrics``: the collector's own view is the only exact
count, and counting needs the proxy's heap, not another process's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.fleet import Fleet, FleetSpec

MODEL = "llama-70b"
_WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
          "kappa", "lambda", "mu", "nu", "xi"]
_LIBS = ("aiohttp", "yarl", "multidict", "propcache", "frozenlist", "aiosignal")
_BUILTIN = {"builtins", "collections", "asyncio.events", "_asyncio", "functools",
            "asyncio.trsock", "_contextvars", "weakref", "_weakrefset", "abc"}


# -- the load: N streams held open (child process) ---------------------------------------------

async def hold_streams(url: str, streams: int, max_tokens: int) -> None:
    """Open ``streams`` streams, print "open" once each has a first byte, hold until stdin says
    anything, then close them all."""
    rng = random.Random(7)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        first: list[asyncio.Future[None]] = []
        tasks = []
        for i in range(streams):
            prompt = f"request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(24))
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            fut = asyncio.get_running_loop().create_future()
            first.append(fut)
            tasks.append(asyncio.create_task(_one(http, url, body, fut)))
        await asyncio.wait_for(asyncio.gather(*first), timeout=120)
        print("open", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def complete(url: str, total: int, concurrency: int, max_tokens: int) -> None:
    """Run ``total`` streams to their end, ``concurrency`` at a time."""
    rng = random.Random(11)
    connector = aiohttp.TCPConnector(limit=0)
    queue = list(range(total))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            prompt = f"done {i}: " + " ".join(rng.choice(_WORDS) for _ in range(24))
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()

    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    print("done", flush=True)


async def _one(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
               first: asyncio.Future[None]) -> None:
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            first.set_exception(RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}"))
            return
        async for _ in resp.content.iter_any():
            if not first.done():
                first.set_result(None)
    if not first.done():
        first.set_exception(RuntimeError(f"stream ended early: HTTP {resp.status}"))


# -- counting (this process) -------------------------------------------------------------------

def _origin(tp: type) -> str:
    """aiohttp (its libraries, and kvproxy's subclasses of its classes, such as the client
    connection's handler: their state is aiohttp's), kvproxy, or other (Python, asyncio, uvloop)."""
    module = tp.__module__ or ""
    if any((base.__module__ or "").split(".")[0] in _LIBS for base in tp.__mro__):
        return "aiohttp"
    if module.startswith(("proxy", "engine_sidecar")):
        return "kvproxy"
    return "other"


def _is_builtin(tp: type) -> bool:
    return (tp.__module__ or "") in _BUILTIN


def census(base_ids: set[int]) -> dict[str, Any]:
    """Objects tracked now that were not at the baseline: by type, by owner's origin."""
    gc.collect()
    objects = gc.get_objects()
    new = {id(o): o for o in objects if id(o) not in base_ids}
    owner: dict[int, int] = {}  # id of a new object -> id of a new object referring to it
    for o in new.values():
        for ref in gc.get_referents(o):
            rid = id(ref)
            if rid in new and rid not in owner:
                owner[rid] = id(o)
    by_type: collections.Counter[str] = collections.Counter()
    by_origin: collections.Counter[str] = collections.Counter()
    charged: collections.Counter[str] = collections.Counter()
    for oid, o in new.items():
        tp = type(o)
        by_type[f"{tp.__module__}.{tp.__qualname__}"] += 1
        by_origin[_origin(tp)] += 1
        holder = _charge(oid, new, owner)
        charged[f"{_origin(holder)}:{holder.__module__}.{holder.__qualname__}"] += 1
    return {"total": len(objects), "new": len(new), "by_type": by_type, "by_origin": by_origin,
            "charged": charged}


def _charge(oid: int, new: dict[int, Any], owner: dict[int, int]) -> type:
    """The first non-builtin type up the chain of new objects that refer to ``oid``."""
    seen = 0
    cur = oid
    while seen < 8:
        tp = type(new[cur])
        if not _is_builtin(tp):
            return tp
        up = owner.get(cur)
        if up is None:
            return tp
        cur, seen = up, seen + 1
    return type(new[cur])


def time_collect(generation: int) -> float:
    began = time.perf_counter()
    gc.collect(generation)
    return time.perf_counter() - began


# -- the run -----------------------------------------------------------------------------------

async def measure(args: argparse.Namespace, fleet: Fleet,
                  levels: list[int]) -> list[dict[str, Any]]:
    """Each level against a proxy of its own, started, warmed and counted at rest just before:
    a proxy that ran an earlier level keeps what that level grew (pooled engine connections,
    filled caches), and counting a later level against the first level's baseline charged all
    of it to the later level's streams."""
    out = []
    for n in levels:
        level = functools.partial(_level, n=n, args=args)
        out.append(await _with_proxy(fleet, args, level))
    if args.garbage:
        out.append(await _with_proxy(fleet, args, lambda url, base: garbage(url, args)))
    return out


async def _with_proxy(fleet: Fleet, args: argparse.Namespace,
                      run: Callable[[str, set[int]], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    from proxy.core.configload import load_config  # noqa: PLC0415
    from proxy.server.lifecycle import ProxyServer, settle_heap  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="perstream-"))
    toml = ["[server]", 'host = "127.0.0.1"', "port = 0", "", "[[pools]]", 'name = "target"',
            f'model = "{MODEL}"']
    for i, url in enumerate(fleet.urls):
        toml += ["", "[[pools.engines]]", f'name = "e{i}"', f'url = "{url}"']
    (work / "kvproxy.toml").write_text("\n".join(toml) + "\n")
    cfg = load_config(str(work / "kvproxy.toml"), os.environ, [])
    server = ProxyServer(cfg)
    await server.start()
    try:
        await _hold(server.url, 16, args)  # warm-up: every code path once, caches filled
        settle_heap(cfg.server.gc_young_threshold, cfg.server.gc_middle_threshold)
        await asyncio.sleep(1.0)
        gc.collect()
        base_ids = {id(o) for o in gc.get_objects()}
        return await run(server.url, base_ids)
    finally:
        await server.drain_and_stop()
        await asyncio.sleep(args.settle_s)  # the engines finish what the aborted streams left


def _saved_garbage() -> collections.Counter[str]:
    """Collect everything, keeping what was cyclic garbage; its types."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}"
                                    for o in gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    return found


async def garbage(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Cyclic garbage per completed stream (what only a collection frees), net of what the idle
    proxy (scrapes) leaves over the same time."""
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    gc.disable()
    try:
        began = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.perstream", "--role", "complete", "--url", url,
            "--streams", str(args.garbage), "--max-tokens", str(args.garbage_tokens),
            stdout=asyncio.subprocess.PIPE)
        await asyncio.wait_for(proc.wait(), timeout=300)
        span = time.perf_counter() - began
        busy = _saved_garbage()
        await asyncio.sleep(span)
        idle = _saved_garbage()
    finally:
        gc.enable()
    kept = census(before)
    net = busy.copy()
    net.subtract(idle)
    n = args.garbage
    return {"garbage_per_stream": round((sum(busy.values()) - sum(idle.values())) / n, 1),
            "busy_garbage": sum(busy.values()),
            "kept_per_stream": round(kept["new"] / n, 2),
            "top_kept": [(k, round(v / n, 2)) for k, v in kept["charged"].most_common(args.top)],
            "idle_garbage": sum(idle.values()), "span_s": round(span, 1), "requests": n,
            "top_garbage": [(k, round(v / n, 2)) for k, v in net.most_common(args.top)]}


async def _hold(url: str, n: int, args: argparse.Namespace,
                at_open: Any = None) -> Any:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.perstream", "--role", "load", "--url", url,
        "--streams", str(n), "--max-tokens", str(args.max_tokens),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=180)
        if line.strip() != b"open":
            raise RuntimeError(f"load generator: {line!r}")
        result = None if at_open is None else await at_open()
        proc.stdin.write(b"stop\n")
        await proc.stdin.drain()
        await asyncio.wait_for(proc.wait(), timeout=60)
        return result
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _level(url: str, base_ids: set[int], *, n: int,
                 args: argparse.Namespace) -> dict[str, Any]:
    async def at_open() -> dict[str, Any]:
        await asyncio.sleep(args.settle_s)  # the streams run a while: gen 1 fills as it would
        gen1 = [time_collect(1)]
        gen2 = [time_collect(2)]
        for _ in range(args.repeat - 1):
            await asyncio.sleep(args.settle_s / 2)
            gen1.append(time_collect(1))
            gen2.append(time_collect(2))
        found = census(base_ids)
        found["gen1_ms"] = [round(1000 * t, 1) for t in gen1]
        found["gen2_ms"] = [round(1000 * t, 1) for t in gen2]
        return found

    found = await _hold(url, n, args, at_open)
    await asyncio.sleep(args.settle_s)  # the aborted streams' ends have run
    found["abort_garbage"] = sum(_saved_garbage().values())
    return _summary(n, found, args.top)


def _summary(n: int, found: dict[str, Any], top: int) -> dict[str, Any]:
    def per(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(k, round(v / n, 2)) for k, v in counter.most_common(top)]

    return {"streams": n, "objects_per_stream": round(found["new"] / n, 1),
            "tracked_total": found["total"], "gen1_ms": found["gen1_ms"],
            "gen2_ms": found["gen2_ms"],
            # Cyclic garbage found right after the client dropped its N streams (scrapes' own
            # garbage over that time included: see the idle figure of ``garbage``).
            "abort_garbage_per_stream": round(found["abort_garbage"] / n, 2),
            "by_origin": {k: round(v / n, 1) for k, v in found["by_origin"].items()},
            "charged_by_origin": _by_prefix(found["charged"], n),
            "top_types": per(found["by_type"]), "top_charged": per(found["charged"])}


def _by_prefix(counter: collections.Counter[str], n: int) -> dict[str, float]:
    out: collections.Counter[str] = collections.Counter()
    for key, v in counter.items():
        out[key.split(":", 1)[0]] += v
    return {k: round(v / n, 1) for k, v in out.items()}


def report(rows: list[dict[str, Any]]) -> str:
    garbage_rows = [r for r in rows if "garbage_per_stream" in r]
    rows = [r for r in rows if "streams" in r]
    lines = ["| streams | tracked objects per stream | aiohttp / kvproxy / other (by type) | "
             "charged to: aiohttp / kvproxy / other | gc.collect(1) ms | gc.collect(2) ms | "
             "cyclic garbage per aborted stream |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        o, c = r["by_origin"], r["charged_by_origin"]
        lines.append(
            f"| {r['streams']} | {r['objects_per_stream']} | "
            f"{o.get('aiohttp', 0)} / {o.get('kvproxy', 0)} / {o.get('other', 0)} | "
            f"{c.get('aiohttp', 0)} / {c.get('kvproxy', 0)} / {c.get('other', 0)} | "
            f"{', '.join(map(str, r['gen1_ms']))} | {', '.join(map(str, r['gen2_ms']))} | "
            f"{r['abort_garbage_per_stream']} |")
    for g in garbage_rows:
        lines += ["", f"Cyclic garbage per completed stream ({g['requests']} streams, "
                  f"{g['span_s']} s, idle garbage {g['idle_garbage']} subtracted): "
                  f"{g['garbage_per_stream']} (all: {g['busy_garbage']})", ""]
        lines += [f"- {k}: {v}" for k, v in g["top_garbage"]]
        lines += ["", f"Still tracked after they ended, per completed stream: "
                  f"{g['kept_per_stream']}, charged to:", ""]
        lines += [f"- {k}: {v}" for k, v in g["top_kept"]]
    for r in rows:
        lines += ["", f"Top types at {r['streams']} streams (per stream):", ""]
        lines += [f"- {k}: {v}" for k, v in r["top_types"]]
        lines += ["", f"Charged to (nearest non-builtin owner) at {r['streams']} streams:", ""]
        lines += [f"- {k}: {v}" for k, v in r["top_charged"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("measure", "load", "complete"), default="measure",
                   help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--streams", default="256,1024", help="open streams, comma separated")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--time-scale", type=float, default=0.1,
                   help="engines' speed; slow so that streams stay open (0.1)")
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=3, help="gc.collect timings per level")
    p.add_argument("--garbage", type=int, default=0,
                   help="also run this many streams to their end and count their cyclic garbage")
    p.add_argument("--garbage-tokens", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.role == "complete":
        asyncio.run(complete(args.url, int(args.streams), 64, args.max_tokens))
        return 0
    if args.role == "load":
        asyncio.run(hold_streams(args.url, int(args.streams), args.max_tokens))
        return 0
    levels = [int(s) for s in args.streams.split(",")]
    spec = FleetSpec(model=MODEL, time_scale=args.time_scale, max_num_seqs=max(levels),
                     num_gpu_blocks=200_000)
    fleet = Fleet(spec, Path(tempfile.mkdtemp(prefix="perstream-fleet-"))).start()
    try:
        import uvloop  # noqa: PLC0415
        rows = uvloop.run(measure(args, fleet, levels))
    finally:
        fleet.stop()
    print(report(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
