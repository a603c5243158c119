"""``kvproxy-sidecar sim``: serve one or more simulated vLLM engines from one process.

Rules: flags map one to one onto ``SimEngineConfig`` fields (vLLM's own flag names where vLLM
has one); ``--engines N`` starts N engines on consecutive ports, engine ``i`` seeded ``seed + i``
with its own fault settings. SIGTERM or SIGINT starts draining: ``/metrics`` reports
``kvproxy_sidecar_draining 1``, new requests get 503, in-flight requests get up to
``--drain-timeout`` seconds to finish, then the process exits 0. uvloop is used when installed, and
the garbage collector is tuned for a long-lived heap (``tune_gc``), both only here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from engine_sidecar.sim.adaptive import run_controllers
from engine_sidecar.sim.cluster import start_cluster
from engine_sidecar.sim.config import FaultConfig, SimEngineConfig
from engine_sidecar.sim.kvevents import KvEventsSettings
from engine_sidecar.sim.profiles import PROFILES, profiles_table

log = logging.getLogger("engine_sidecar.sim")


def _csv_floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        msg = f"expected comma-separated numbers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _port(text: str) -> int:
    """A TCP port to listen on: 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port in 0..65535")
    return port


def _range(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}")
    return int(parts[0]), int(parts[1])


def _override(text: str) -> tuple[str, float]:
    name, sep, value = text.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected METRIC=VALUE, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("serving")
    serve.add_argument("--engines", type=int, default=1, help="engines in this process (1)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8100,
                       help="port of the first engine; the others follow (8100; 0: any free)")
    serve.add_argument("--model", "--served-model-name", dest="model", default="sim-model",
                       help="model name served (sim-model)")
    serve.add_argument("--name", default=None,
                       help="engine name for X-Engine-Id, suffixed -0, -1, ... with --engines > 1 "
                       "(default sim-<port>)")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get after SIGTERM (30)")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--list-profiles", action="store_true",
                       help="print the profiles' derived figures (Markdown) and exit")
    model = parser.add_argument_group("engine model")
    model.add_argument("--profile", choices=sorted(PROFILES), default="llama8b-l4")
    model.add_argument("--time-scale", type=float, default=1.0,
                       help="divide every modelled duration by this (1.0: real time)")
    model.add_argument("--num-gpu-blocks", type=int, default=None,
                       help="KV-cache blocks (default: what fits the profile's GPU)")
    model.add_argument("--block-size", type=int, default=16)
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--max-num-batched-tokens", type=int, default=8192)
    model.add_argument("--max-model-len", type=int, default=8192)
    model.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    model.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false")
    model.add_argument("--num-speculative-tokens", type=int, default=0)
    model.add_argument("--adaptive-speculation", action="store_true",
                       help="run the adaptive speculation controller for every speculating "
                            "engine of this process (one pool: one engine out at a time); its "
                            "kvproxy_sidecar_spec_* series join each engine's /metrics")
    model.add_argument("--spec-acceptance", type=_csv_floats, default=(),
                       help="acceptance probability per draft position, e.g. 0.8,0.6,0.4")
    model.add_argument("--output-len", type=_range, default=(64, 512),
                       help="MIN,MAX of the natural answer length before 'stop' (64,512)")
    model.add_argument("--legacy-kv-metric", action="store_true",
                       help="emit vllm:gpu_cache_usage_perc (vLLM <= 0.10) instead")
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--draft-agreement", type=float, default=1.0,
                       help="as a draft model: how often its greedy words are the target's (1.0)")
    model.add_argument("--tokenizer", default=None,
                       help="a model's tokenizer.json (or its directory): tokenize prompts as "
                            "vLLM serving that model does, instead of 4 bytes per token")
    _add_kv_event_arguments(parser)
    _add_fault_arguments(parser)


def _add_kv_event_arguments(parser: argparse.ArgumentParser) -> None:
    events = parser.add_argument_group(
        "KV-cache events (vLLM's --kv-events-config; ports move up by one per engine)")
    events.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                        help="publish KV events on this ZMQ endpoint: tcp://*:5557 binds, "
                        "tcp://HOST:PORT connects to a subscriber that binds (default: off)")
    events.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                        help="bind a ROUTER socket that replays buffered batches")
    events.add_argument("--kv-events-topic", default="", help="topic frame of every message")
    events.add_argument("--kv-events-buffer-steps", type=int, default=10_000,
                        help="batches kept for replay (10000)")
    events.add_argument("--kv-events-bytes-hashes", dest="kv_events_int_hashes",
                        action="store_false",
                        help="send whole 32-byte hashes, as vLLM with "
                        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (default: 64-bit integers)")


def _kv_events(args: argparse.Namespace) -> KvEventsSettings:
    return KvEventsSettings(endpoint=args.kv_events_endpoint,
                            replay_endpoint=args.kv_events_replay_endpoint,
                            topic=args.kv_events_topic, buffer_steps=args.kv_events_buffer_steps,
                            int_hashes=args.kv_events_int_hashes)


def _add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    faults = parser.add_argument_group("fault injection (also: POST /admin/faults)")
    faults.add_argument("--fault-error-rate", type=float, default=0.0)
    faults.add_argument("--fault-error-status", type=int, default=500)
    faults.add_argument("--fault-reset-after-tokens", type=int, default=None)
    faults.add_argument("--fault-stall-after-tokens", type=int, default=None)
    faults.add_argument("--fault-stall-s", type=float, default=0.0)
    faults.add_argument("--fault-header-delay-s", type=float, default=0.0)
    faults.add_argument("--fault-metrics-status", type=int, default=None)
    faults.add_argument("--fault-metrics-frozen", action="store_true")
    faults.add_argument("--fault-metrics-missing", action="append", default=[],
                        metavar="METRIC", help="leave this metric out of /metrics (repeatable)")
    faults.add_argument("--fault-metric-override", action="append", default=[], type=_override,
                        metavar="METRIC=VALUE", help="report VALUE for METRIC (repeatable)")


def _faults(args: argparse.Namespace) -> FaultConfig:
    faults = FaultConfig()
    faults.update({
        "error_rate": args.fault_error_rate, "error_status": args.fault_error_status,
        "reset_after_tokens": args.fault_reset_after_tokens,
        "stall_after_tokens": args.fault_stall_after_tokens, "stall_s": args.fault_stall_s,
        "header_delay_s": args.fault_header_delay_s, "metrics_status": args.fault_metrics_status,
        "metrics_frozen": args.fault_metrics_frozen,
        "metrics_missing": list(args.fault_metrics_missing),
        "metric_overrides": dict(args.fault_metric_override),
    })
    return faults


def _engine_name(name: str | None, engines: int, index: int) -> str | None:
    if name is None or engines == 1:
        return name
    return f"{name}-{index}"


def configs_from_args(args: argparse.Namespace) -> list[SimEngineConfig]:
    """One validated config per engine; ``ValueError`` names the bad setting."""
    if args.engines < 1:
        raise ValueError("--engines must be >= 1")
    kv_events = _kv_events(args)
    return [
        SimEngineConfig(
            model=args.model, name=_engine_name(args.name, args.engines, i),
            profile=args.profile, num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, scheduling_policy=args.scheduling_policy,
            enable_prefix_caching=args.enable_prefix_caching, time_scale=args.time_scale,
            num_speculative_tokens=args.num_speculative_tokens, acceptance=args.spec_acceptance,
            legacy_kv_metric=args.legacy_kv_metric, seed=args.seed + i,
            stop_len_range=args.output_len, faults=_faults(args),
            draft_agreement=args.draft_agreement,
            kv_events=kv_events.for_engine(i), tokenizer=args.tokenizer,
        )
        for i in range(args.engines)
    ]


def tune_gc() -> None:
    """Keep the collector out of the token path.

    Hundreds of open streams keep a large, long-lived heap; CPython's default thresholds then run
    full collections over it often enough to stall the event loop for tens of milliseconds, which
    shows up as inter-token jitter. Objects alive after start-up are frozen out of collection and
    collections of young objects happen less often (their cost is per collection, not per object).
    """
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)


async def serve(configs: list[SimEngineConfig], host: str, port: int, drain_timeout: float,
                adaptive: bool = False) -> None:
    cluster = await start_cluster(configs, host=host, port=port)
    tune_gc()
    controllers = (asyncio.create_task(run_controllers(cluster.engines, cluster.spec_lease),
                                       name="sim-speculation-controllers") if adaptive else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for engine, url in zip(cluster.engines, cluster.urls, strict=True):
            log.info("engine %s serving model %r (%s, %d KV blocks of %d) at %s", engine.name,
                     engine.model, engine.config.profile, engine.pool.num_blocks,
                     engine.config.block_size, url)
        await stop.wait()
        log.info("draining: %d request(s) in flight", cluster.in_flight)
        if await cluster.drain(drain_timeout):
            log.info("drained; stopping")
        else:
            log.warning("drain timeout: aborting %d request(s)", cluster.in_flight)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if controllers is not None:
            controllers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await controllers
        await cluster.close()


def _runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    try:
        import uvloop  # noqa: PLC0415  (optional; chosen only here, at the entry point)
    except ImportError:
        return asyncio.run
    return uvloop.run


def run(args: argparse.Namespace) -> int:
    if args.list_profiles:
        print(profiles_table(args.block_size))
        return 0
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        configs = configs_from_args(args)
    except ValueError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    try:
        with contextlib.suppress(KeyboardInterrupt):
            _runner()(serve(configs, args.host, args.port, args.drain_timeout,
                            args.adaptive_speculation))
    except OSError as exc:  # a port in use, an address this machine does not have
        log.error("cannot start: %s", exc)
        return 1
    return 0
