"""Routers under test: kvproxy and the peer routers, started on loopback in front of the engines.

Rules:
- A router is named ``<router>/<policy>``; each knows its own command line, readiness URL,
  request headers and version, and nothing about benchmarks.
- Peers run from their own virtual environments under ``.venv-peers/<name>`` (made by
  ``bench/install-peers.sh``); a peer whose environment is missing is *unavailable*, with the
  reason.
- Every server binds 127.0.0.1 only (metrics listeners too) and is stopped by PID after its run.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from bench.loadgen import Endpoint
from bench.procs import Managed, free_port

REPO = Path(__file__).resolve().parent.parent
PEERS_DIR = REPO / ".venv-peers"
LITELLM_KEY = "sk-kvproxy-bench"

KVPROXY_POLICIES = ("round_robin", "least_load", "prefix_affinity", "expected_ttft")
# kvproxy's prefix-aware policies also run in precise mode when named ``kvproxy/<policy>+precise``.
PRECISE = "+precise"
PRECISE_POLICIES = ("prefix_affinity", "expected_ttft")
# ``kvproxy/expected_ttft+abandon``: the cost model with ``routing.charge_abandoned = true``
# written out (the default since the charge was bounded to settled holdings; the arm was how the
# rule was measured live before that).
ABANDON = "+abandon"
ABANDON_POLICIES = ("expected_ttft",)
# ``kvproxy/expected_ttft+plain``: the same with the rule off (the model before the charge), to
# measure the default against it live and interleaved.
PLAIN = "+plain"
# ... and as ``kvproxy serve --workers N`` when named ``kvproxy/<policy>+wN``.
WORKER_COUNTS = (2, 3, 4)
PEER_POLICIES = {
    "vllm-router": ("round_robin", "cache_aware", "consistent_hash"),
    "sglang-router": ("round_robin", "cache_aware"),
    "litellm": ("least-busy",),
}
# Reference routers for the overhead benchmark (``bench.floor``): aiohttp alone, not routers
# anyone would run; named only explicitly, never part of "every router".
FLOOR_POLICIES = ("aiohttp", "aiohttp-splice", "tcp")
PACKAGES = {"vllm-router": "vllm-router", "sglang-router": "sglang-router", "litellm": "litellm"}


@dataclass(frozen=True)
class Router:
    router: str  # "kvproxy", "vllm-router", "sglang-router", "litellm", "floor"
    policy: str
    workers: int = 1  # kvproxy only: ``kvproxy serve --workers N`` (named ``<policy>+wN``)

    @property
    def name(self) -> str:
        suffix = f"+w{self.workers}" if self.workers > 1 else ""
        return f"{self.router}/{self.policy}{suffix}"

    @property
    def precise(self) -> bool:
        """kvproxy in precise mode (``<policy>+precise``): the engines publish KV events and
        tokenize with ``bench.wordtok``; the proxy subscribes and tokenizes the same way."""
        return self.router == "kvproxy" and self.policy.endswith(PRECISE)

    @property
    def abandon(self) -> bool:
        """kvproxy with ``routing.charge_abandoned`` on (``<policy>+abandon``)."""
        return self.router == "kvproxy" and self.policy.endswith(ABANDON)

    @property
    def plain(self) -> bool:
        """kvproxy with ``routing.charge_abandoned`` off (``<policy>+plain``)."""
        return self.router == "kvproxy" and self.policy.endswith(PLAIN)

    @property
    def venv(self) -> Path:
        return PEERS_DIR / self.router

    def unavailable(self) -> str | None:
        """Why this router cannot run here, or None."""
        if self.router in ("kvproxy", "floor"):
            try:
                __import__("proxy.cli")
            except ImportError as exc:
                return f"kvproxy not importable: {exc}"
            return None
        if not (self.venv / "bin" / "python").exists():
            return f"not installed ({self.venv} missing; run bench/install-peers.sh)"
        return None

    def version(self) -> str:
        if self.router == "kvproxy":
            return _own_version()
        if self.router == "floor":
            return f"aiohttp {metadata.version('aiohttp')}"
        code = f"import importlib.metadata as m; print(m.version({PACKAGES[self.router]!r}))"
        try:
            out = subprocess.run([str(self.venv / "bin" / "python"), "-c", code],
                                 capture_output=True, text=True, timeout=60, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unknown ({exc})"
        return out.stdout.strip()

    def launch(self, engine_urls: Sequence[str], model: str, work_dir: Path,
               cores: str | None, events: Sequence[str] = ()) -> tuple[Managed, Endpoint, str]:
        """Start the router; returns the process, the endpoint to send to and its readiness URL.
        ``events``: in precise mode, per engine, the endpoint the proxy binds for its KV events."""
        port = free_port()
        work_dir.mkdir(parents=True, exist_ok=True)
        if self.precise:
            argv, env, ready, headers = _kvproxy(self, engine_urls, model, port, work_dir, events)
        else:
            argv, env, ready, headers = _BUILDERS[self.router](self, engine_urls, model, port,
                                                                work_dir)
        proc = Managed(self.name.replace("/", "-"), argv, work_dir / f"{self.router}.log",
                       env=env, cores=cores).start()
        endpoint = Endpoint(name=self.name, base_url=f"http://127.0.0.1:{port}", model=model,
                            headers=tuple(headers.items()))
        return proc, endpoint, ready


def launch_ready(router: Router, engine_urls: Sequence[str], model: str, work_dir: Path,
                 cores: str | None, *, timeout_s: float = 90.0, attempts: int = 2,
                 events: Sequence[str] = ()) -> tuple[Managed, Endpoint]:
    """Start ``router`` and wait until it answers; one retry on a fresh port if it dies."""
    for attempt in range(attempts):
        proc, endpoint, ready = router.launch(engine_urls, model, work_dir, cores, events)
        try:
            proc.wait_http(ready, timeout_s=timeout_s, headers=dict(endpoint.headers))
        except RuntimeError:
            proc.stop()
            if attempt == attempts - 1:
                raise
            continue
        return proc, endpoint
    raise AssertionError("unreachable")


def _own_version() -> str:
    try:
        return metadata.version("kvproxy")
    except metadata.PackageNotFoundError:
        return "unknown"


Built = tuple[list[str], dict[str, str], str, dict[str, str]]


def _kvproxy(r: Router, urls: Sequence[str], model: str, port: int, work: Path,
             events: Sequence[str] = ()) -> Built:
    """kvproxy's command; with ``events`` (precise mode) the pool's tokenizer is
    ``work/tokenizer`` and the proxy binds each engine's KV-event endpoint (loopback only)."""
    policy = r.policy.removesuffix(PRECISE).removesuffix(ABANDON).removesuffix(PLAIN)
    lines = ["[server]", 'host = "127.0.0.1"', f"port = {port}", "",
             "[routing]", f'policy = "{policy}"']
    if r.abandon or r.plain:
        lines.append(f"charge_abandoned = {'true' if r.abandon else 'false'}")
    lines += ["", "[[pools]]", 'name = "target"', f'model = "{model}"']
    if events:
        lines.append(f'tokenizer = "{work / "tokenizer"}"')
    for i, url in enumerate(urls):
        lines += ["", "[[pools.engines]]", f'name = "e{i}"', f'url = "{url}"']
        if events:
            lines.append(f'kv_events = {{ endpoint = "{events[i]}", bind = true }}')
    cfg = work / "kvproxy.toml"
    cfg.write_text("\n".join(lines) + "\n")
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(cfg)]
    if r.workers > 1:
        argv += ["--workers", str(r.workers)]
    return argv, {}, f"http://127.0.0.1:{port}/ready", {}


def _vllm_router(r: Router, urls: Sequence[str], model: str, port: int, work: Path) -> Built:
    argv = [str(r.venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--policy", r.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--log-level", "warning"]
    return argv, {}, f"http://127.0.0.1:{port}/health", {}


def _floor(r: Router, urls: Sequence[str], model: str, port: int, work: Path) -> Built:
    argv = [sys.executable, "-m", "bench.floor", "--port", str(port), "--engines", ",".join(urls)]
    if r.policy == "aiohttp-splice":
        argv.append("--splice")
    elif r.policy == "tcp":
        argv.append("--tcp")
    return argv, {}, f"http://127.0.0.1:{port}/health", {}


def _sglang_router(r: Router, urls: Sequence[str], model: str, port: int, work: Path) -> Built:
    argv = [str(r.venv / "bin" / "python"), "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
            "--policy", r.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--log-level", "warn"]
    return argv, {}, f"http://127.0.0.1:{port}/health", {}


def _litellm(r: Router, urls: Sequence[str], model: str, port: int, work: Path) -> Built:
    lines = ["model_list:"]
    for url in urls:
        lines += [f"  - model_name: {model}",
                  "    litellm_params:",
                  f"      model: openai/{model}",
                  f"      api_base: {url}/v1",
                  "      api_key: none",
                  "      timeout: 600",
                  "      stream_timeout: 600"]
    lines += ["router_settings:", f"  routing_strategy: {r.policy}",
              "litellm_settings:", "  num_retries: 0", "  request_timeout: 600",
              "  drop_params: false",
              "general_settings:", f"  master_key: {LITELLM_KEY}"]
    cfg = work / "litellm.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    argv = [str(r.venv / "bin" / "litellm"), "--config", str(cfg), "--host", "127.0.0.1",
            "--port", str(port), "--num_workers", "1"]
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": LITELLM_KEY,
           "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR", "NO_DOCS": "True"}
    headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
    return argv, env, f"http://127.0.0.1:{port}/health/liveliness", headers


_BUILDERS = {
    "kvproxy": _kvproxy,
    "vllm-router": _vllm_router,
    "sglang-router": _sglang_router,
    "litellm": _litellm,
    "floor": _floor,
}


def all_routers(peers: bool = True) -> list[Router]:
    out = [Router("kvproxy", p) for p in KVPROXY_POLICIES]
    if peers:
        out += [Router(name, p) for name, policies in PEER_POLICIES.items() for p in policies]
    return out


def parse_router_list(text: str) -> list[Router]:
    """``kvproxy/prefix_affinity,vllm-router/*`` -> routers; ``*`` means every policy."""
    known = {r.name: r for r in all_routers()}
    known.update({(r := Router("floor", p)).name: r for p in FLOOR_POLICIES})
    known.update({f"kvproxy/{p}{PRECISE}": Router("kvproxy", p + PRECISE)
                  for p in PRECISE_POLICIES})
    known.update({f"kvproxy/{p}{ABANDON}": Router("kvproxy", p + ABANDON)
                  for p in ABANDON_POLICIES})
    known.update({f"kvproxy/{p}{PLAIN}": Router("kvproxy", p + PLAIN) for p in ABANDON_POLICIES})
    known.update({(r := Router("kvproxy", p, n)).name: r
                  for p in KVPROXY_POLICIES for n in WORKER_COUNTS})
    out: list[Router] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        router, _, policy = item.partition("/")
        if policy in ("", "*"):
            matches = [r for r in known.values() if r.router == router]
        else:
            matches = [known[item]] if item in known else []
        if not matches:
            raise ValueError(f"unknown router {item!r}; known: {', '.join(known)}")
        out += [m for m in matches if m not in out]
    return out
