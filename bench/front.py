"""The front of one replica-benchmark run: N kvproxy replicas, HAProxy before them, and Redis.

Rules:
- Pure text first: the arms' names, HAProxy's config, a replica's config and HAProxy's stats CSV
  are functions of their arguments; the processes come after.
- Every process is a ``bench.procs.Managed``: started here, stopped here by its PID (on failure
  while starting, nothing started is left running). Everything binds loopback ports only.
- HAProxy runs in HTTP mode with ``balance roundrobin``: every request is balanced on its own, also
  on kept-alive client connections; one thread (it shares the router core with the replicas).
- Replicas share the benchmark's redis-server; each run has its own key prefix, so no run reads
  another's routing state. ``sharing`` off keeps Redis and disables only the routing-state sharing.
"""

from __future__ import annotations

import re
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.fleet import parse_counters
from bench.loadgen import Endpoint
from bench.procs import Managed, free_port, http_get, tree_cpu_seconds

# Debian installs it in /usr/sbin, which is not on every PATH.
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
POLICY = "expected_ttft"
REPLICA_COUNTERS = ("kvproxy_requests_total",)
COMPARED = "@compared"  # suffix of the arms run from ``--compare-tree``


@dataclass(frozen=True)
class Arm:
    replicas: int
    haproxy: bool = True
    sharing: bool = True
    # Another source tree to run the replicas from (``--compare-tree``: the same arm with the
    # code before a change, interleaved with it); "" for this one.
    tree: str = ""

    @property
    def name(self) -> str:
        return self.base_name + (COMPARED if self.tree else "")

    @property
    def base_name(self) -> str:
        if not self.haproxy:
            return f"direct-{self.replicas}"
        if self.replicas == 1:
            return "haproxy-1"
        return f"haproxy-{self.replicas}-{'shared' if self.sharing else 'alone'}"


def parse_arms(text: str) -> list[Arm]:
    """``haproxy-4-shared,direct-1`` -> arms; ValueError naming a bad item."""
    out: list[Arm] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"(direct|haproxy)-(\d{1,2})(?:-(shared|alone))?", item)
        n = int(m.group(2)) if m else 0
        if m is None or n < 1 or (m.group(1) == "direct" and (n != 1 or m.group(3))):
            raise ValueError(f"unknown arm {item!r}: direct-1, haproxy-1, haproxy-N-shared or "
                             "haproxy-N-alone")
        arm = Arm(n, m.group(1) == "haproxy", m.group(3) != "alone")
        if arm not in out:
            out.append(arm)
    return out


def haproxy_config(port: int, stats_port: int, backends: Sequence[int], timeout_s: float) -> str:
    """HAProxy in HTTP mode, round-robin over ``backends`` (loopback ports), stats as CSV."""
    t = f"{max(1, round(timeout_s))}s"
    servers = [f"    server r{i} 127.0.0.1:{p}" for i, p in enumerate(backends)]
    return "\n".join([
        "global", "    nbthread 1", "    maxconn 4096", "",
        "defaults", "    mode http", "    timeout connect 5s", f"    timeout client {t}",
        f"    timeout server {t}", "    timeout http-keep-alive 60s", "    maxconn 4096", "",
        "frontend kvproxy", f"    bind 127.0.0.1:{port}", "    default_backend replicas", "",
        "backend replicas", "    balance roundrobin", *servers, "",
        "listen stats", f"    bind 127.0.0.1:{stats_port}", "    stats enable",
        "    stats uri /stats", "",
    ])


def haproxy_requests(csv: str) -> dict[str, float]:
    """Per server of the ``replicas`` backend, the requests HAProxy sent it (its stats CSV:
    ``req_tot`` where reported, else ``stot``, sessions, one per request in HTTP mode)."""
    lines = csv.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    header = lines[0][2:].split(",")
    out: dict[str, float] = {}
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") != "replicas" or row.get("svname") in ("FRONTEND", "BACKEND"):
            continue
        value = row.get("req_tot") or row.get("stot") or ""
        out[row.get("svname", "?")] = float(value) if value.isdigit() else 0.0
    return out


def replica_config(port: int, engine_urls: Sequence[str], model: str, redis_url: str,
                   key_prefix: str, sharing: bool) -> str:
    lines = ["[server]", 'host = "127.0.0.1"', f"port = {port}", "",
             "[routing]", f'policy = "{POLICY}"', "",
             "[redis]", f'url = "{redis_url}"', f'key_prefix = "{key_prefix}"', "",
             "[sharing]", f"enabled = {'true' if sharing else 'false'}", "",
             "[[pools]]", 'name = "target"', f'model = "{model}"']
    for i, url in enumerate(engine_urls):
        lines += ["", "[[pools.engines]]", f'name = "e{i}"', f'url = "{url}"']
    return "\n".join(lines) + "\n"


@dataclass
class Front:
    """The replicas of one run and, for a HAProxy arm, the balancer in front of them."""

    replicas: list[tuple[Managed, str]]  # process, base URL
    haproxy: Managed | None
    endpoint: Endpoint
    stats_url: str | None

    @property
    def procs(self) -> list[Managed]:
        return [p for p, _ in self.replicas] + ([self.haproxy] if self.haproxy else [])

    def cpu_seconds(self) -> float:
        return sum(tree_cpu_seconds(p.pid) for p in self.procs if p.alive())

    def replica_requests(self) -> list[float]:
        out = []
        for _, url in self.replicas:
            status, text = http_get(url + "/metrics", timeout_s=5.0)
            counts = parse_counters(text, REPLICA_COUNTERS) if status == 200 else {}
            out.append(counts.get("kvproxy_requests_total", 0.0))
        return out

    def replica_samples(self, prefix: str) -> dict[str, float]:
        """Samples of the families named ``prefix...`` summed over the replicas, keyed by the
        sample's name and labels (e.g. the shared decisions' outcomes and round-trip buckets)."""
        out: dict[str, float] = {}
        for _, url in self.replicas:
            status, text = http_get(url + "/metrics", timeout_s=5.0)
            for line in text.splitlines() if status == 200 else []:
                if line.startswith(prefix):
                    key, _, value = line.rpartition(" ")
                    out[key] = out.get(key, 0.0) + float(value)
        return out

    def balancer_requests(self) -> dict[str, float]:
        if self.stats_url is None:
            return {}
        status, text = http_get(self.stats_url, timeout_s=5.0)
        return haproxy_requests(text) if status == 200 else {}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def start_front(arm: Arm, urls: Sequence[str], model: str, redis_url: str, key_prefix: str,
                work: Path, cores: str | None, timeout_s: float,
                overrides: Sequence[str] = ()) -> Front:
    """Start the replicas (all at once, then wait for each; ``overrides``: ``kvproxy serve
    --set`` items for every replica) and HAProxy; on failure nothing started here is left
    running."""
    front = Front([], None, Endpoint("", "", model), None)
    try:
        for i in range(arm.replicas):
            port = free_port()
            cfg = work / f"replica-{i}.toml"
            cfg.write_text(replica_config(port, urls, model, redis_url, key_prefix, arm.sharing))
            # -P: the working directory (this tree) must not shadow the compared one.
            python = [sys.executable, "-P"] if arm.tree else [sys.executable]
            argv = [*python, "-m", "proxy", "serve", "--log-level", "warning",
                    "--config", str(cfg), *(x for o in overrides for x in ("--set", o))]
            env = {"PYTHONPATH": arm.tree} if arm.tree else {}  # before the installed package
            proc = Managed(f"kvproxy-{i}", argv, work / f"replica-{i}.log", env=env, cores=cores)
            front.replicas.append((proc.start(), f"http://127.0.0.1:{port}"))
        for proc, url in front.replicas:
            proc.wait_http(url + "/ready", timeout_s=90.0)
        base = front.replicas[0][1]
        if arm.haproxy:
            base = _start_haproxy(front, work, cores, timeout_s)
        front.endpoint = Endpoint(arm.name, base, model)
        return front
    except BaseException:
        front.stop()
        raise


def _start_haproxy(front: Front, work: Path, cores: str | None, timeout_s: float) -> str:
    port, stats = free_port(), free_port()
    backends = [int(url.rsplit(":", 1)[1]) for _, url in front.replicas]
    cfg = work / "haproxy.cfg"
    cfg.write_text(haproxy_config(port, stats, backends, timeout_s))
    front.haproxy = Managed("haproxy", [HAPROXY, "-db", "-f", str(cfg)], work / "haproxy.log",
                            cores=cores).start()
    base = f"http://127.0.0.1:{port}"
    front.stats_url = f"http://127.0.0.1:{stats}/stats;csv"
    front.haproxy.wait_http(front.stats_url, timeout_s=30.0)
    front.haproxy.wait_http(base + "/ready", timeout_s=30.0)
    return base


@dataclass
class Redis:
    """The benchmark's own redis-server on a free loopback port (no persistence)."""

    work: Path
    cores: str | None
    proc: Managed | None = None
    url: str = ""

    def start(self) -> Redis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh --redis)")
        port = free_port()
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"]
        self.proc = Managed("redis", argv, self.work / "redis.log", cores=self.cores).start()
        self.url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while not _redis_answers(port):
            if not self.proc.alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start: {self.proc.log_tail()}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
